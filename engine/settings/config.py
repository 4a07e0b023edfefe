"""The engine's flags (vLLM's names) as one validated dataclass.

Each field is declared once, with ``setting(...)`` (``engine/settings/declare.py``): its flag, its
kind, its ``--help`` line and its CRD field; what each accepts is ``config_values.py``'s.
They are declared by concept: the workload (``workload_config.py``), the device and its
memory caps (``device_config.py``), LoRA adapters (``lora_config.py``); ``EngineConfig``
composes the three, in that order. ``add_engine_flags`` (``config_flags.py``),
``EngineConfig.to_flags``, and the operator's CRD schema and spec mapping are generated
from those declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.settings.declare import check_settings, render_flags
from kvledger.engine.settings.device_config import DeviceSettings
from kvledger.engine.settings.lora_config import LoraSettings
from kvledger.engine.settings.workload_config import WorkloadSettings


@dataclass(frozen=True)
class EngineConfig(LoraSettings, DeviceSettings, WorkloadSettings):
    """Every flag the planner and engine read. ``None`` means "derive it" (see docs/planner.md).

    One declaration per field (``setting``): its default, its flag, its kind, its help and,
    for the InferenceService's ``spec.engine``/``spec.memory``, its CRD field. Its fields
    are the workload's, then the device's, then LoRA's (a dataclass lists a base's fields
    first, the last base's first of all)."""

    def __post_init__(self) -> None:
        check_settings(self)  # each value in its kind's domain, then the rules across them
        self.check_workload()
        self.check_device()
        self.check_lora()

    def to_flags(self) -> list[str]:
        """The command-line flags that reproduce this config (inverse of the parser)."""
        flags = render_flags(self)
        if self.served_model_aliases and self.served_model_name is not None:
            after_name = flags.index("--served-model-name") + 2
            flags[after_name:after_name] = self.served_model_aliases
        return flags
