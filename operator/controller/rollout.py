"""Which of a Deployment's pods run the resource's current spec: its rollout.

``Ready`` means "serving the current spec", so a spec update must not be reported ready
by the pods of the spec before it. Two things have to be current for the Deployment's
counts to be about this spec:

- the operator applied this generation: ``apply_children`` writes the resource's
  ``metadata.generation`` on the Deployment (annotation ``APPLIED_GENERATION``), so a
  status computed between the resource's update and the apply (or from an index that has
  not seen the new Deployment yet) does not read the old one as current;
- the Deployment controller acted on it: ``status.observedGeneration`` is the
  Deployment's ``metadata.generation`` (``kubectl rollout status``'s first test); until
  then ``updatedReplicas`` counts the previous template's pods.

The Deployment counts its pods of the current template (``updatedReplicas``) and its
available pods of every template (``availableReplicas``), not the available ones of the
current template; at least ``available - (replicas - updated)`` are (every older pod
counted as available): a lower bound, exact once no older pod is left. A Deployment with
no status yet has no pods either; then (and for a LeaderWorkerSet) there is no rollout
to read and the pods' own readiness counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.operator.api.status_types import DeploymentEntry

# On the Deployment's metadata (not its pod template: that would roll the pods at every
# generation, a scale included): the resource's generation it was rendered from.
APPLIED_GENERATION = "kvledger.dev/generation"


@dataclass(frozen=True)
class Rollout:
    """The Deployment's pods against the resource's current spec.

    ``current``: the Deployment holds this generation's template and its controller has
    acted on it; ``updated``: its pods of that template (0 while not ``current``);
    ``serving``: how many of those are available, at least; ``older``: its pods of an
    earlier template, still there."""

    current: bool
    updated: int
    serving: int
    older: int

    @property
    def done(self) -> bool:
        """Nothing of an earlier spec is left, and the controller has seen this one."""
        return self.current and self.older == 0


def rollout_of(entry: DeploymentEntry | None, generation: int | None) -> Rollout | None:
    """The rollout of the resource's ``generation`` from its Deployment's index entry;
    None without a Deployment or before its controller wrote a status (no pods then)."""
    if entry is None:
        return None
    counts = entry.get("status") or {}
    observed = counts.get("observedGeneration")
    if not isinstance(observed, int):
        return None
    applied = entry.get("applied")
    # An older operator's Deployment has no annotation: its own generation is all there is.
    applied_now = applied is None or generation is None or applied == str(generation)
    own = entry.get("generation")
    observed_now = not isinstance(own, int) or observed >= own
    pods = _count(counts, "replicas")
    if not (applied_now and observed_now):
        return Rollout(current=False, updated=0, serving=0, older=pods)
    updated = min(_count(counts, "updatedReplicas"), pods) if pods else 0
    older = pods - updated
    serving = max(0, min(updated, _count(counts, "availableReplicas") - older))
    return Rollout(current=True, updated=updated, serving=serving, older=older)


def _count(counts: dict[str, object], key: str) -> int:
    value = counts.get(key)
    return value if isinstance(value, int) and value > 0 else 0
