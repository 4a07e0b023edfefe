"""One pipeline stage of a model (``--pipeline-parallel-size``): its decoder layers, the
input embedding on the first stage, the final norm and the LM head on the last, as vLLM
builds a stage. Which layers and tensors a stage holds is ``planner/stages.py``'s rule,
the one the plan counts, so a stage loads exactly the bytes its plan says
(tests/engine/model/test_pipeline_stages.py).

``StageLM`` takes the first stage's token ids, or an earlier stage's hidden states, and
gives the next stage's input, or on the last stage the hidden states after the final norm
that ``logits`` turns into logits: stage after stage, the same numbers as the whole
model's forward pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.model.attention import AttentionMetadata
from kvledger.engine.model.transformer import DecoderLayer, RMSNorm, embed, scaled_logits
from kvledger.engine.planner.stages import stage_bounds, tensor_stages

_LAYER = re.compile(r"((?:^|\.)layers\.)(\d+)\.")


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` of ``count``, holding decoder layers ``[first_layer, end_layer)``."""

    index: int
    count: int
    first_layer: int
    end_layer: int

    @classmethod
    def of(cls, config: ModelConfig, index: int, count: int) -> Stage:
        start, end = stage_bounds(config.num_layers, count)[index]
        return cls(index, count, start, end)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def holds(self, name: str, config: ModelConfig) -> bool:
        """Whether checkpoint tensor ``name`` is this stage's."""
        bounds = stage_bounds(config.num_layers, self.count)
        return self.index in tensor_stages(name, bounds, config.tie_word_embeddings)

    def local_name(self, name: str, config: ModelConfig) -> str:
        """``name`` as this stage's module holds it: its layers counted from 0; the tied
        embedding, on a last stage that is not the first, as the LM head."""
        if not self.first and config.tie_word_embeddings and name.endswith("embed_tokens.weight"):
            return "lm_head.weight"
        return _LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) - self.first_layer}.",
                          name, count=1)


class _StageDecoder(nn.Module):
    def __init__(self, config: ModelConfig, stage: Stage) -> None:
        super().__init__()
        if stage.first:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # The global index: a mixture-of-experts model's dense layers are named by it.
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(stage.first_layer, stage.end_layer))
        if stage.last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class StageLM(nn.Module):
    """``model.*`` and ``lm_head`` of one stage, named as in Hugging Face's checkpoints."""

    def __init__(self, config: ModelConfig, stage: Stage) -> None:
        super().__init__()
        self.config, self.stage = config, stage
        self.model = _StageDecoder(config, stage)
        if stage.last:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[torch.Tensor] | None, meta: AttentionMetadata) -> torch.Tensor:
        """The first stage takes token ids, a later one the hidden states ``[num_tokens,
        hidden]`` before it; the last gives them after the final norm."""
        x = embed(self.model.embed_tokens, inputs, self.config) if self.stage.first else inputs
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if kv_caches is None else kv_caches[i], meta)
        return self.model.norm(x) if self.stage.last else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scaled_logits(self.lm_head(hidden), self.config)
