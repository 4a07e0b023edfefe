"""A request with penalties is sampled every step of an output that grows every step: a
step must read the ids its output added since the last, not the whole output again (the
engine thread's step is every tenant's). Work is counted (the ids turned into tensors), not
timed, and the penalised rows are checked against the counts of the whole output."""

from __future__ import annotations

import torch

from kvledger.engine.core.sequence import Sequence
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.sampling.sampler import process_logits

VOCAB, STEPS = 64, 1500
PROMPT = list(range(0, 40, 3))


def _recounted(logits: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    """vLLM's penalties from the whole output, counted from scratch."""
    counts = torch.zeros(VOCAB)
    for token in output:
        counts[token] += 1
    seen = counts > 0
    seen[PROMPT] = True
    p = params.repetition_penalty
    logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def test_a_step_reads_the_ids_its_output_added(monkeypatch):
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2,
                            presence_penalty=0.1)
    seq = Sequence("s", PROMPT, params, STEPS, None, None, None)
    ids_read = []
    tensor = torch.tensor

    def counting(data, *args, **kwargs):
        if isinstance(data, list):
            ids_read.append(len(data))
        return tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        row = process_logits(logits, seq, frozenset())
        if step % 250 == 0 or step == STEPS - 1:
            assert torch.allclose(row, _recounted(logits, seq.output_token_ids, params))
        seq.output_token_ids.append((step * 7) % VOCAB)
    # each output id once, the prompt once: the whole output every step would be ~STEPS²/2
    assert sum(ids_read) <= STEPS + len(PROMPT) + 8, sum(ids_read)


def test_each_sequence_is_penalised_by_its_own_output_alone():
    # Counts are kept per sequence: two requests stepped in turn (as in one batch), each
    # row is penalised by its own output only, whatever the other wrote.
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2,
                            presence_penalty=0.1)
    a = Sequence("a", PROMPT, params, 200, None, None, None)
    b = Sequence("b", PROMPT, params, 200, None, None, None)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    for step in range(200):
        for seq, token in ((a, 1), (b, (step * 5) % VOCAB)):
            row = process_logits(logits, seq, frozenset())
            assert torch.allclose(row, _recounted(logits, seq.output_token_ids, params))
            seq.output_token_ids.append(token)
    assert not torch.allclose(process_logits(logits, a, frozenset()),
                              process_logits(logits, b, frozenset()))
