"""LoRA adapters as the flags declare them, vLLM's names: ``--enable-lora``,
``--lora-modules NAME=PATH ...`` (or vLLM's JSON form ``{"name", "path",
"base_model_name"}``), ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``; and
``LoRARequest``, the per-request adapter of the Python API.

The flags are declared here (``LoraSettings``), which ``EngineConfig`` composes.
Torch-free: the planner reads these (the memory the engine preallocates for the adapter
slots, ``planner/lora_bytes.py``); the engine loads the adapters (``model/lora_adapter.py``).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_values import LORA
from kvledger.engine.settings.declare import Crd, setting
from kvledger.engine.settings.kinds import SWITCH, Kind

# vLLM's defaults (vllm/config/lora.py): one adapter in a batch, rank up to 16.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
# The ranks vLLM accepts for --max-lora-rank (its kernels are built for these).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# An adapter's name (the CRD's spec.adapters[].name pattern too).
LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True)
class LoraModule:
    """One adapter of ``--lora-modules``: the name requests use, its PEFT directory (or
    ``hf://ORG/NAME[@REVISION]``), and the base model it was trained on (informational,
    as in vLLM)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not LORA_NAME_RE.match(self.name):
            raise BadInput(f"--lora-modules: bad adapter name {self.name!r} (letters, digits "
                           "and . _ : / @ + -, at most 128 characters)")
        if not isinstance(self.path, str) or not self.path:
            raise BadInput(f"--lora-modules {self.name}: the adapter needs a path")

    def as_flag(self) -> str:
        """How ``--lora-modules`` writes it back (``NAME=PATH`` unless it has a base)."""
        if self.base_model_name is None:
            return f"{self.name}={self.path}"
        return json.dumps({"name": self.name, "path": self.path,
                           "base_model_name": self.base_model_name})


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter, vLLM's shape: ``LoRARequest(lora_name, lora_int_id,
    lora_path)``. ``lora_int_id`` (>= 1) identifies the weights: two requests with the same
    id use the same adapter, and the prefix cache keys their blocks by it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise BadInput(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer "
                           f">= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise BadInput(f"LoRARequest {self.lora_name!r}: lora_path is required")


def lora_module_arg(text: str) -> LoraModule:
    """argparse type of one ``--lora-modules`` item: ``NAME=PATH`` or vLLM's JSON."""
    try:
        if text.lstrip().startswith("{"):
            try:
                raw = json_text.loads(text)
            except ValueError as exc:
                raise BadInput(f"--lora-modules {text}: not valid JSON ({exc})") from None
            unknown = set(raw) - {"name", "path", "base_model_name"} if isinstance(raw, dict) else ()
            if not isinstance(raw, dict) or unknown or "name" not in raw or "path" not in raw:
                raise BadInput(f"--lora-modules {text}: the JSON form is {{\"name\": ..., "
                               "\"path\": ..., \"base_model_name\": ...}")
            return LoraModule(raw["name"], raw["path"], raw.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep:
            raise BadInput(f"--lora-modules {text}: expected NAME=PATH or JSON")
        return LoraModule(name, path)
    except BadInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_lora_flags(enable_lora: bool, modules: tuple[LoraModule, ...], max_loras: int,
                     max_lora_rank: int, max_cpu_loras: int | None) -> None:
    """BadInput, one line, for flags that contradict each other (vLLM's rules)."""
    for flag, value in (("max-loras", max_loras), ("max-lora-rank", max_lora_rank),
                        ("max-cpu-loras", max_cpu_loras)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            raise BadInput(f"--{flag} must be a positive integer, got {value!r}")
    if max_lora_rank not in LORA_RANKS:
        raise BadInput(f"--max-lora-rank {max_lora_rank}: must be one of "
                       f"{', '.join(map(str, LORA_RANKS))} (as in vLLM)")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise BadInput(f"--max-cpu-loras {max_cpu_loras} is below --max-loras {max_loras}: "
                       "every adapter in a batch is held on the host too")
    if modules and not enable_lora:
        raise BadInput("--lora-modules needs --enable-lora")
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise BadInput(f"--lora-modules names {twice[0]!r} twice")


# Their kinds of setting (engine/settings/kinds.py), for LoraSettings' fields. The counts
# are checked together (check_lora_flags), as vLLM does.
LORA_MODULES = Kind("lora-modules", parse=lora_module_arg, nargs="+", metavar="NAME=PATH",
                    render=lambda modules: [m.as_flag() for m in modules])
LORA_COUNT = Kind("positive", parse=int)
LORA_RANK = Kind("choice", parse=int, values=LORA_RANKS)


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags, each declared once (``setting``); checked together by
    ``check_lora``."""

    enable_lora: bool = setting(
        False, "--enable-lora", SWITCH, group=LORA,
        help="serve LoRA adapters beside the base model: a request names one in `model`; "
             "adapters and the base run in the same batch",
        crd=Crd("engine", "serve LoRA adapters (--enable-lora; on with spec.adapters; alone, "
                          "for adapters loaded at run time)"))
    lora_modules: tuple[LoraModule, ...] = setting(  # the operator sets it from spec.adapters
        (), "--lora-modules", LORA_MODULES, group=LORA,
        help="adapters served from the start: NAME=PATH (a PEFT directory with "
             "adapter_config.json and adapter_model.safetensors, or hf://ORG/NAME[@REVISION]) "
             "or JSON {\"name\", \"path\", \"base_model_name\"}")
    max_loras: int = setting(
        DEFAULT_MAX_LORAS, "--max-loras", LORA_COUNT, group=LORA,
        help=f"adapters in one batch (default {DEFAULT_MAX_LORAS}): the slots the engine "
             "preallocates; a request whose adapter finds no slot waits",
        crd=Crd("engine", "adapters in one batch: the slots preallocated (--max-loras, "
                          "default 1)"))
    max_lora_rank: int = setting(
        DEFAULT_MAX_LORA_RANK, "--max-lora-rank", LORA_RANK, group=LORA,
        help=f"the largest rank an adapter may have (default {DEFAULT_MAX_LORA_RANK}; one of "
             f"{', '.join(map(str, LORA_RANKS))}); each slot is preallocated at this rank",
        crd=Crd("engine", "the largest adapter rank (--max-lora-rank, default 16)"))
    max_cpu_loras: int | None = setting(
        None, "--max-cpu-loras", LORA_COUNT, group=LORA,
        help="adapters held loaded in host memory (default --max-loras); others are read from "
             "disk again when a request needs them",
        crd=Crd("engine", "adapters held in host memory (--max-cpu-loras)"))

    def check_lora(self) -> None:
        """``lora_modules`` as a tuple; BadInput, one line, for LoRA flags that contradict
        each other."""
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        check_lora_flags(self.enable_lora, self.lora_modules, self.max_loras,
                         self.max_lora_rank, self.max_cpu_loras)
