"""Header-only planning of a 70B-class checkpoint, against safetensors' own header reading.

Writes a sharded Llama-3-70B-shaped bf16 checkpoint (about 131 GiB) as SPARSE files in a
temporary directory: each shard is its real header followed by a truncate to the full
size, so no tensor data touches the disk. Then times, in the same run:

  baseline  every shard opened with ``safetensors.safe_open`` and each tensor's dtype and
            shape read (what a loader does before it reads data)
  ours      ``read_weights`` (headers parsed by hand and validated), and a whole
            ``make_plan`` (config, weights, budget) that fits and one that is refused
            (remedies found by re-planning)

and prints the best time of each (the least disturbed by other load) and the ratio
baseline / ours.

    .venv/bin/python bench/plan_speed.py [--shards 30] [--repeat 31]

``--write-only DIR`` writes the same sparse checkpoint to DIR and exits without timing
anything, so a reader can plan it themselves (the README's 70B refusal):

    .venv/bin/python bench/plan_speed.py --write-only /tmp/llama-3-70b-sparse
    .venv/bin/kvledger plan --model /tmp/llama-3-70b-sparse --device-memory 192GiB ...
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

from kvledger.engine.checkpoint.contents import read_weights
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
          "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
          "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
          "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def tensor_shapes(c: dict) -> dict[str, list[int]]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                   p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                   p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                   p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                   p + "post_attention_layernorm.weight": [h]}
    return shapes


def write_sparse_checkpoint(model_dir: Path, shards: int) -> int:
    """config.json, N sparse shards and the index; returns the total tensor bytes."""
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    names = list(tensor_shapes(CONFIG).items())
    per_shard = -(-len(names) // shards)
    weight_map, total = {}, 0
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for name, shape in names[k * per_shard:(k + 1) * per_shard]:
            nbytes = 2
            for d in shape:
                nbytes *= d
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = shard
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads headers to 8 bytes
        with open(model_dir / shard, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # sparse: the data region is a hole
        total += offset
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def checkpoint_names(shards: int) -> set[str]:
    """The file names ``write_sparse_checkpoint`` writes for ``shards`` shards."""
    return {"config.json", "model.safetensors.index.json",
            *(f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards))}


def write_only(model_dir: Path, shards: int) -> int:
    """Write the sparse checkpoint to ``model_dir`` (created) and report it; exit status.

    A folder holding anything but this checkpoint's own files is refused (exit 2), so a
    mistyped path never mixes our shards into someone's model; rewriting ours is fine.
    """
    if model_dir.exists() and not model_dir.is_dir():
        print(f"error: {model_dir} exists and is not a folder", file=sys.stderr)
        return 2
    model_dir.mkdir(parents=True, exist_ok=True)
    ours = checkpoint_names(shards)
    foreign = sorted(p.name for p in model_dir.iterdir() if p.name not in ours)
    if foreign:
        print(f"error: {model_dir} holds other files ({', '.join(foreign[:3])}"
              f"{', ...' if len(foreign) > 3 else ''}): give an empty or new folder",
              file=sys.stderr)
        return 2
    total = write_sparse_checkpoint(model_dir, shards)
    on_disk = sum(p.stat().st_blocks * 512 for p in model_dir.iterdir())
    print(f"wrote a Llama-3-70B-shaped bf16 checkpoint to {model_dir}: {shards} shards, "
          f"{total / GiB:.1f} GiB of tensors, {on_disk / 2**20:.1f} MiB actually on disk (sparse)")
    return 0


def safe_open_headers(model_dir: Path) -> int:
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles have no __iter__
                s = f.get_slice(name)
                n = {"BF16": 2}[s.get_dtype()]
                for d in s.get_shape():
                    n *= d
                total += n
    return total


def best_seconds(fn, repeat: int) -> tuple[float, object]:
    """The fastest of ``repeat`` runs: the least disturbed by other load on the machine."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--shards", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=31)
    parser.add_argument("--write-only", type=Path, default=None, metavar="DIR",
                        help="write the sparse checkpoint to DIR and exit, timing nothing")
    args = parser.parse_args()
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    if args.write_only is not None:
        sys.exit(write_only(args.write_only, args.shards))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        total = write_sparse_checkpoint(model_dir, args.shards)
        on_disk = sum(p.stat().st_blocks * 512 for p in model_dir.iterdir())
        print(f"checkpoint: {args.shards} shards, {total / GiB:.1f} GiB of tensors, "
              f"{on_disk / 2**20:.1f} MiB actually on disk (sparse)")
        fits = EngineConfig(model=str(model_dir), device_memory_bytes=192 * GiB, max_model_len=8192)
        refused = EngineConfig(model=str(model_dir), device_memory_bytes=80 * GiB,
                               max_model_len=8192)
        base_s, base_bytes = best_seconds(lambda: safe_open_headers(model_dir), args.repeat)
        ours_s, info = best_seconds(lambda: read_weights(model_dir), args.repeat)
        plan_s, plan = best_seconds(lambda: make_plan(fits), args.repeat)
        refuse_s, refusal = best_seconds(lambda: make_plan(refused), args.repeat)
        assert info.total_bytes == base_bytes == total, (info.total_bytes, base_bytes, total)
        assert plan.fits and not refusal.fits
        print(f"safe_open headers (baseline): {base_s * 1e3:8.2f} ms")
        print(f"read_weights (ours):          {ours_s * 1e3:8.2f} ms   "
              f"ratio baseline/ours {base_s / ours_s:.2f}x")
        print(f"make_plan, fits:              {plan_s * 1e3:8.2f} ms   "
              f"ratio baseline/ours {base_s / plan_s:.2f}x")
        print(f"make_plan, refused + {len(refusal.remedies)} remedies: {refuse_s * 1e3:6.2f} ms   "
              f"ratio baseline/ours {base_s / refuse_s:.2f}x")


if __name__ == "__main__":
    main()
