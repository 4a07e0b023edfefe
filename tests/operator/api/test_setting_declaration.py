"""A new engine setting is one declaration (engine/settings/declare.py): it appears in the CRD's
schema, the command line, the spec's mapping and the pod's flags with no other edit."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from kvledger.engine.errors import BadInput
from kvledger.engine.settings import kinds as setting_kinds
from kvledger.engine.settings import serve_values
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_flags import add_engine_flags, config_from_args
from kvledger.engine.settings.config_values import MEMORY, WORKLOAD
from kvledger.engine.settings.declare import Crd, setting
from kvledger.engine.settings.kinds import POSITIVE_INT, SIZE, Kind
from kvledger.operator.api.crd_schema import SPEC_SCHEMA
from kvledger.operator.api.setting_schema import KIND_SCHEMAS, SIZE_PATTERN, setting_properties
from kvledger.operator.api.spec import spec_settings


@dataclass(frozen=True)
class WithNewFields(EngineConfig):
    """EngineConfig plus two settings declared the one way a real field is."""

    max_logprobs: int = setting(
        20, "--max-logprobs", POSITIVE_INT, group=WORKLOAD,
        help="the most logprobs a request may ask for (default 20)",
        crd=Crd("engine", "the most logprobs a request may ask for (--max-logprobs)"))
    swap_space_bytes: int | None = setting(
        None, "--swap-space", SIZE, group=MEMORY, help="host memory for swapped blocks",
        crd=Crd("memory", "host memory for swapped blocks (--swap-space)", name="swap"))


def test_the_crd_schema_has_the_new_fields() -> None:
    assert setting_properties("engine", WithNewFields)["maxLogprobs"] == {
        "type": "integer", "minimum": 1,
        "description": "the most logprobs a request may ask for (--max-logprobs)"}
    assert setting_properties("memory", WithNewFields)["swap"] == {
        "type": "string", "pattern": SIZE_PATTERN,
        "description": "host memory for swapped blocks (--swap-space)"}
    # ... and EngineConfig's own schema is what the CRD holds.
    for section in ("engine", "memory"):
        assert (setting_properties(section)
                == SPEC_SCHEMA["properties"][section]["properties"])
    assert "maxLogprobs" not in setting_properties("engine")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser, WithNewFields)
    return parser


def test_the_command_line_has_the_new_flags() -> None:
    text = _parser().format_help()
    assert "--max-logprobs MAX_LOGPROBS" in text and "--swap-space SIZE" in text
    config = config_from_args(_parser().parse_args(["/m", "--max-logprobs", "5",
                                                    "--swap-space", "1GiB"]), WithNewFields)
    assert (config.max_logprobs, config.swap_space_bytes) == (5, 2**30)
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["/m", "--max-logprobs", "0"])
    assert exc.value.code == 2


def test_the_config_checks_the_new_fields_by_their_kind() -> None:
    with pytest.raises(BadInput, match=r"^--max-logprobs must be a positive integer, got 0$"):
        WithNewFields(model="/m", max_logprobs=0)
    with pytest.raises(BadInput, match=r"^--swap-space must be a positive integer, got -1$"):
        WithNewFields(model="/m", swap_space_bytes=-1)


def test_the_spec_maps_onto_the_new_fields() -> None:
    raw = {"engine": {"maxLogprobs": 5, "maxNumSeqs": 4}, "memory": {"swap": "1Gi"}}
    assert spec_settings(raw, WithNewFields) == {
        "max_num_seqs": 4, "max_logprobs": 5, "swap_space_bytes": 2**30}
    with pytest.raises(BadInput, match=r"^memory\.swap must be more than 0 bytes"):
        spec_settings({"memory": {"swap": 0}}, WithNewFields)


def test_the_pod_flags_carry_the_new_fields_and_parse_back() -> None:
    config = WithNewFields(model="/m", max_logprobs=5, swap_space_bytes=2**30)
    flags = config.to_flags()
    assert flags == ["--model", "/m", "--max-logprobs", "5", "--swap-space", str(2**30)]
    assert config_from_args(_parser().parse_args(flags), WithNewFields) == config
    assert WithNewFields(model="/m").to_flags() == ["--model", "/m"]  # defaults: no flag


def test_every_kind_of_setting_has_a_crd_type() -> None:
    """So a field of any kind needs no edit in the operator."""
    kinds = [k for module in (setting_kinds, serve_values)
             for k in vars(module).values() if isinstance(k, Kind)]
    assert kinds and all(k.domain in KIND_SCHEMAS or k.domain == "choice" for k in kinds)
