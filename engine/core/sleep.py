"""Sleep mode (``--enable-sleep-mode``): the engine gives back its device memory and takes
it again, as vLLM 0.32's ``sleep``/``wake_up`` do.

- level 0: nothing moves; the engine only stops taking requests (vLLM's paused scheduler).
- level 1: the weights move to host memory (pinned, on a GPU; on the CPU they are host
  memory already and stay), the KV pool is freed.
- level 2: the weights and the KV pool are freed; waking reads the weights again from the
  checkpoint (``runner.weights``), arranged as before (fused projections, packed layers).

The KV pool's contents are lost either way, so the prefix cache is cleared (with KV events
on, one ``AllBlocksCleared``). Decode graphs point at the old pool and weights: they are
dropped on sleep and captured again on wake. ``wake(tags)`` takes vLLM's tags
(``weights``, ``kv_cache``; none: both); the engine is awake once both are back.

Only the front door calls this, with nothing admitted and nothing running: the engine's
loop is idle, so no step sees memory move. One process only (no tensor or pipeline ranks)
and no LoRA slots: both are refused at start-up (``check``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvledger.engine.core.runner import ModelRunner
from kvledger.engine.errors import BadInput
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.estimates import format_size
from kvledger.engine.settings.config import EngineConfig

log = logging.getLogger("kvledger.sleep")

LEVELS = (0, 1, 2)
TAGS = ("weights", "kv_cache")
# A first wake's estimate, before one was measured: host->device copies (level 1) and a
# checkpoint's read (level 2), in bytes per second. A measured wake replaces them.
ASSUMED_COPY_BPS = 8e9
ASSUMED_READ_BPS = 1e9


def check(config: EngineConfig) -> None:
    """BadInput for a run sleep mode cannot serve (before anything is loaded)."""
    if not config.enable_sleep_mode:
        return
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        raise BadInput("--enable-sleep-mode needs one process: no --tensor-parallel-size or "
                       "--pipeline-parallel-size above 1")
    if config.enable_lora:
        raise BadInput("--enable-sleep-mode with --enable-lora: the adapter slots would "
                       "stay resident; not supported yet")


def check_host(weights_bytes: int, host: DeviceMemory) -> None:
    """On a GPU, level 1 keeps the weights in (pinned) host memory: BadInput, before
    anything is loaded, when the container's host memory could not hold them."""
    if weights_bytes <= host.free_bytes:
        return
    short = weights_bytes - host.free_bytes
    raise BadInput(f"--enable-sleep-mode: sleep level 1 keeps the weights "
                   f"({format_size(weights_bytes)}) in host memory, but {host.name} has "
                   f"{format_size(host.free_bytes)} free of {format_size(host.total_bytes)}: "
                   f"give the container {format_size(short)} more memory, or serve without "
                   "--enable-sleep-mode")


@dataclass
class Sleep:
    """The engine's sleep state: ``level`` (None: awake) and what is still to be woken."""

    runner: ModelRunner
    ledger: KVLedger
    weights_bytes: int = 0  # the plan's: what a level-2 wake reads again
    level: int | None = None
    asleep: set[str] = field(default_factory=set)  # of TAGS: what is freed or offloaded
    seconds: dict[str, float] = field(default_factory=dict)  # "sleep 1", "wake 2", ...
    _host: dict[str, torch.Tensor] = field(default_factory=dict)
    _kv: tuple[tuple[int, ...], torch.dtype] | None = None
    _graph_sizes: list[int] | None = None

    def sleep(self, level: int) -> float:
        """Free what ``level`` frees (the caller has drained the engine); its seconds."""
        if level not in LEVELS:
            raise BadInput(f"sleep level {level}: vLLM's are 0, 1 and 2", param="level")
        if self.level is not None:
            raise BadInput(f"the engine is asleep already (level {self.level}); wake it first",
                           param="level")
        started = time.perf_counter()
        runner = self.runner
        self.level = level  # from here on, what fails half-way is put back by wake()
        if level >= 1:
            self.ledger.prefix_cache.reset()  # the pool's contents go
            if runner.decode_graphs is not None:
                self._graph_sizes = runner.decode_graphs.sizes
                runner.decode_graphs = None
            self._kv = (tuple(runner.kv_cache.shape), runner.kv_cache.dtype)
            runner.kv_cache = None
            self.asleep.add("kv_cache")
            if level == 1 and runner.device.type != "cpu":
                self._host = {key: _to_host(t) for key, t in _tensors(runner.model).items()}
                _free(runner.model)
                self.asleep.add("weights")
            elif level == 2:
                _free(runner.model)
                self.asleep.add("weights")
            _empty_cache(runner.device)
        self.seconds[f"sleep {level}"] = elapsed = time.perf_counter() - started
        log.info("asleep at level %d in %.3f s (%s freed)", level, elapsed,
                 ", ".join(sorted(self.asleep)) or "nothing")
        return elapsed

    def wake(self, tags: list[str] | None = None) -> bool:
        """Take back what ``tags`` name (None: everything); True once fully awake."""
        if self.level is None:
            return True
        unknown = sorted(set(tags or ()) - {*TAGS, "scheduling"})
        if unknown:
            raise BadInput(f"wake_up tags {unknown}: vLLM's are weights, kv_cache and "
                           "scheduling", param="tags")
        wanted = set(TAGS) if not tags else set(tags) & set(TAGS)
        started = time.perf_counter()
        runner, level = self.runner, self.level
        if "weights" in wanted & self.asleep:
            if self._host:
                _put(runner.model, {key: t.to(runner.device, non_blocking=True)
                                    for key, t in self._host.items()})
                self._host = {}
            else:  # level 2: read again, arranged as the runner arranged the first read
                runner.model = _reloaded(runner)
            self.asleep.discard("weights")
        if "kv_cache" in wanted & self.asleep:
            shape, dtype = self._kv
            runner.kv_cache = torch.zeros(shape, dtype=dtype, device=runner.device)
            self.asleep.discard("kv_cache")
        if not self.asleep and self._graph_sizes is not None:
            runner.use_decode_graphs(self._graph_sizes, capture=runner.device.type == "cuda")
            self._graph_sizes = None
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        key = f"wake {level}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - started
        if self.asleep:
            return False
        self.level = None
        log.info("awake from level %d in %.3f s", level, self.seconds[key])
        return True

    def predicted_wake_s(self) -> float:
        """How long waking the present level should take: the last measured wake of that
        level, else the bytes to bring back over an assumed bandwidth."""
        if self.level is None:
            return 0.0
        measured = self.seconds.get(f"wake {self.level}")
        if measured is not None:
            return measured
        if self.level == 2:
            return self.weights_bytes / ASSUMED_READ_BPS
        return sum(t.numel() * t.element_size() for t in self._host.values()) / ASSUMED_COPY_BPS


Key = tuple[torch.nn.Module, str, bool]  # (module, name, is a parameter)


def _tensors(model: torch.nn.Module) -> dict[Key, torch.Tensor]:
    """Every parameter and buffer of ``model`` by where it sits, each tensor once (a tied
    weight is one parameter in two modules: moved or freed once, seen by both)."""
    seen: set[int] = set()
    out: dict[Key, torch.Tensor] = {}
    for module in model.modules():
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    out[(module, name, kind)] = tensor
    return out


def _put(model: torch.nn.Module, tensors: dict[Key, torch.Tensor]) -> None:
    """Each parameter's data, each buffer itself, from ``tensors``."""
    for (module, name, is_param), tensor in tensors.items():
        if is_param:
            module._parameters[name].data = tensor
        else:
            module._buffers[name] = tensor


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                       pin_memory=torch.cuda.is_available())
    return host.copy_(tensor.detach())


def _free(model: torch.nn.Module) -> None:
    """Every tensor of ``model`` replaced by an empty one on its device (its memory goes
    with the last reference)."""
    _put(model, {key: torch.empty(0, dtype=t.dtype, device=t.device)
                 for key, t in _tensors(model).items()})


def _reloaded(runner: ModelRunner) -> torch.nn.Module:
    from kvledger.engine.model.cpu_linear import pack_linears
    from kvledger.engine.model.fusion import fuse_projections

    if runner.weights is None:
        raise RuntimeError("a runner without its Weights cannot wake from level 2")
    model = runner.weights.load()
    if runner.fused:
        fuse_projections(model)
    if runner.packed:
        pack_linears(model, runner.device, measure=False)
    return model


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
