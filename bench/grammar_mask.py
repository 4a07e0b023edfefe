"""Per-token cost of grammar-constrained decoding with xgrammar, llguidance and outlines-core.

Structured outputs (OpenAI ``response_format``) mask the logits at every decoding step, on
the engine's step thread: every constrained sequence pays this cost on every token.
This script measures it on a 32,000-token vocabulary:

  1. trains a byte-level BPE tokenizer (``tokenizers``) on the Python sources of this
     interpreter's site-packages, special tokens <s>, </s>, <|end|> (EOS: </s>), cached in
     --workdir;
  2. for each grammar library that imports (the others are skipped with a line), builds its
     tokenizer view once ("setup"), then for two cases
       json_schema  an object with a string, an integer and an array of strings, all required
       json_object  any JSON object (the schema {"type": "object"})
     compiles the grammar (median of 3, "compile") and walks a fixed valid document, token by
     token and then EOS, --walks times, each walk with a fresh matcher of the compiled grammar;
  3. per token it times: fill the library's int32 bitmask + apply it to a float32 [vocab]
     torch logits tensor (numpy unpackbits + torch.where, the same for every library) +
     accept the token. It reports p50/p99/mean µs over all walks, the mean of the first walk
     alone ("cold": lazily built lexer states land there) and the mean of each phase.

    .venv/bin/python bench/grammar_mask.py [--walks 30] [--json] [--workdir DIR]

Every token of the document is checked to be allowed by the mask before it is accepted, so
a library that masks wrongly fails the run instead of looking fast.

Exit status 1, one line on stderr per failed check, when no library measured any case, or
when llguidance (the library engine/sampling/grammar.py uses) was skipped or failed a case.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = ["<s>", "</s>", "<|end|>"]
EOS = "</s>"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
CASES = {
    "json_schema": (SCHEMA, {"name": "Ada Lovelace", "age": 36,
                             "tags": ["mathematics", "poetry", "analytical engine", "notes"]}),
    "json_object": ({"type": "object"},
                    {"id": 12345, "user": {"name": "Grace Hopper", "email": "grace@example.com",
                                           "active": True, "score": -3.25e2, "team": None},
                     "items": [1, 2, 3, {"k": False}], "note": "a \"quoted\" word and café"}),
}
MINUS_INF = torch.tensor(float("-inf"))
REQUIRED = "llguidance"  # the library the engine uses: it must measure every case


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--walks", type=int, default=30,
                        help="walks of each document per library and case (default 30)")
    parser.add_argument("--vocab", type=int, default=32000, help="tokenizer vocabulary size")
    parser.add_argument("--corpus-mb", type=int, default=16,
                        help="MiB of Python source to train the tokenizer on (default 16)")
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "kvledger-grammar-bench",
                        help="where the trained tokenizer is cached")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser.parse_args()


def train_tokenizer(path: Path, vocab: int, corpus_mb: int):
    """A byte-level BPE tokenizer of ``vocab`` tokens, trained once and cached at ``path``."""
    from tokenizers import Tokenizer

    from kvledger.engine.model.bpe import train_byte_level_bpe

    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = train_byte_level_bpe(python_sources(corpus_mb * 2**20), vocab, SPECIAL_TOKENS)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def python_sources(limit_bytes: int):
    """The text of site-packages' .py files, in a fixed order, up to ``limit_bytes``."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
        text = path.read_text(errors="replace")
        yield text
        total += len(text)
        if total >= limit_bytes:
            return


def document_tokens(tokenizer, document: dict, eos_id: int) -> list[int]:
    """The ids of ``document`` as json.dumps writes it (", ", ": "), then EOS."""
    text = json.dumps(document, ensure_ascii=False)
    return [*tokenizer.encode(text, add_special_tokens=False).ids, eos_id]


def byte_level_vocab(tokenizer) -> list[str]:
    """Each id's token as the tokenizer stores it (byte-level characters); "" for specials."""
    specials = set(tokenizer.get_added_tokens_decoder())
    tokens = [""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        tokens[token_id] = "" if token_id in specials else token
    return tokens


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class Llguidance:
    name, package = "llguidance", "llguidance"

    def __init__(self, tokenizer, eos_id: int, vocab_size: int) -> None:
        import llguidance

        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                                 eos_token=eos_id)

    def compile(self, schema: dict):
        grammar = self._llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self._llg.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)


class Xgrammar:
    name, package = "xgrammar", "xgrammar"

    def __init__(self, tokenizer, eos_id: int, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo(byte_level_vocab(tokenizer), xgrammar.VocabType.BYTE_LEVEL,
                                      vocab_size=vocab_size, stop_token_ids=[eos_id])
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict):
        return self._compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask.view(1, -1))

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)


class OutlinesCore:
    name, package = "outlines-core", "outlines_core"

    def __init__(self, tokenizer, eos_id: int, vocab_size: int) -> None:
        import outlines_core

        self._oc = outlines_core
        to_byte = byte_decoder()
        tokens: dict[bytes, list[int]] = {}
        for token_id, token in enumerate(byte_level_vocab(tokenizer)):
            if token:
                tokens.setdefault(bytes(to_byte[c] for c in token), []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(eos_id, tokens)
        self._eos_id = eos_id

    def compile(self, schema: dict):
        regex = self._oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self._oc.Index(regex, self._vocabulary)

    def matcher(self, compiled):
        return self._oc.Guide(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def accept(self, matcher, token_id: int) -> bool:
        if token_id == self._eos_id:  # allowed in a final state, which has no transition on it
            return matcher.is_finished()
        matcher.advance(token_id, return_tokens=False)
        return True  # advance raises on a token the state does not allow


LIBRARIES = [Xgrammar, Llguidance, OutlinesCore]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logit of every token whose bit is 0 to -inf, in place, as engine/sampling/grammar.py
    does (bit i of word w is token 32 w + i: numpy's little-endian unpack of the bytes)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), count=logits.shape[0], bitorder="little")
    torch.where(torch.from_numpy(bits).view(torch.bool), logits, MINUS_INF, out=logits)


def walk(library, matcher, token_ids: list[int], vocab_size: int) -> list[tuple[float, ...]]:
    """(fill, apply, accept) seconds for each token of one walk through ``token_ids``."""
    base = torch.randn(vocab_size)
    logits = torch.empty(vocab_size)
    bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    timings = []
    for position, token_id in enumerate(token_ids):
        logits.copy_(base)
        t0 = time.perf_counter()
        library.fill(matcher, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        if logits[token_id] == float("-inf"):
            raise RuntimeError(f"{library.name} masked out token {position} ({token_id}) of "
                               "a valid document")
        t3 = time.perf_counter()
        if not library.accept(matcher, token_id):
            raise RuntimeError(f"{library.name} refused token {position} ({token_id})")
        t4 = time.perf_counter()
        timings.append((t1 - t0, t2 - t1, t4 - t3))
    return timings


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def measure_case(library, schema: dict, token_ids: list[int], vocab_size: int,
                 walks: int) -> dict:
    compiles = [timed(library.compile, schema) for _ in range(3)]
    compiled = compiles[-1][0]
    per_walk = [walk(library, library.matcher(compiled), token_ids, vocab_size)
                for _ in range(walks)]
    totals = [sum(step) * 1e6 for steps in per_walk for step in steps]
    phases = [statistics.fmean(step[i] for steps in per_walk for step in steps) * 1e6
              for i in range(3)]
    quantiles = statistics.quantiles(totals, n=100, method="inclusive")
    return {"tokens": len(token_ids), "compile_ms": statistics.median(t for _, t in compiles) * 1e3,
            "p50_us": quantiles[49], "p99_us": quantiles[98], "mean_us": statistics.fmean(totals),
            "cold_mean_us": statistics.fmean(sum(step) for step in per_walk[0]) * 1e6,
            "fill_us": phases[0], "apply_us": phases[1], "accept_us": phases[2]}


def measure_library(cls, tokenizer, documents: dict, eos_id: int, vocab_size: int,
                    walks: int) -> dict:
    library, setup_seconds = timed(cls, tokenizer, eos_id, vocab_size)
    cases = {}
    for case, (schema, _) in CASES.items():
        token_ids = documents[case]
        try:
            cases[case] = measure_case(library, schema, token_ids, vocab_size, walks)
        except Exception as exc:  # a library that cannot do a case is reported, not fatal
            cases[case] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"version": importlib.metadata.version(cls.package),
            "setup_ms": setup_seconds * 1e3, "cases": cases}


def print_table(results: dict) -> None:
    header = ("| library | version | case | tokens | setup ms | compile ms | p50 µs | p99 µs "
              "| mean µs | cold mean µs | fill µs | apply µs | accept µs |")
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for name, result in results["libraries"].items():
        for case, row in result["cases"].items():
            start = f"| {name} | {result['version']} | {case} |"
            if "error" in row:
                print(f"{start} failed: {row['error']} |")
                continue
            print(f"{start} {row['tokens']} | {result['setup_ms']:.0f} | {row['compile_ms']:.1f} "
                  f"| {row['p50_us']:.1f} | {row['p99_us']:.1f} | {row['mean_us']:.1f} "
                  f"| {row['cold_mean_us']:.1f} | {row['fill_us']:.1f} | {row['apply_us']:.1f} "
                  f"| {row['accept_us']:.1f} |")


def failures(results: dict) -> list[str]:
    """One line per failed check: no library measured a case; llguidance skipped or failed."""
    libraries = results["libraries"]
    lines = []
    if not any("error" not in row for result in libraries.values()
               for row in result["cases"].values()):
        lines.append("no grammar library produced a measurement (every one was skipped or "
                     "failed)")
    if REQUIRED not in libraries:
        lines.append(f"{REQUIRED}, the library the engine uses, was skipped (not importable)")
    else:
        lines += [f"{REQUIRED}, the library the engine uses, failed {case}: {row['error']}"
                  for case, row in libraries[REQUIRED]["cases"].items() if "error" in row]
    return lines


def main() -> int:
    args = parse_args()
    tokenizer = train_tokenizer(args.workdir / f"bpe-{args.vocab}.json", args.vocab,
                                args.corpus_mb)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = tokenizer.token_to_id(EOS)
    documents = {case: document_tokens(tokenizer, doc, eos_id) for case, (_, doc) in CASES.items()}
    results = {"vocab_size": vocab_size, "walks": args.walks, "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "libraries": {}}
    for cls in LIBRARIES:
        try:
            __import__(cls.package)
        except ImportError as exc:
            print(f"skipping {cls.name}: not importable ({exc})", file=sys.stderr)
            continue
        results["libraries"][cls.name] = measure_library(cls, tokenizer, documents, eos_id,
                                                         vocab_size, args.walks)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"vocab {vocab_size}, {args.walks} walks per case, torch {torch.__version__} "
              f"({torch.get_num_threads()} threads); per token = fill + apply + accept")
        print_table(results)
    failed = failures(results)
    for line in failed:
        print(f"grammar_mask: FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
