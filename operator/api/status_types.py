"""The InferenceService's status as the operator writes it, and the parts of a pod's status
it is computed from: the types of the status seam (``controller/status.py`` computes one
from the other; ``controller/handlers.py`` patches it). JSON as the API server sends and
takes it, so ``TypedDict``s: a pod's status comes from kopf's index as its JSON, the
resource's status goes out as a merge patch. Each lists only the fields read or written
here; Kubernetes' own ``V1PodStatus`` and ``V1ContainerStatus`` hold the rest.
"""

from __future__ import annotations

from typing import TypedDict

# A JSON value: the plan line's figures are copied through as the pre-flight wrote them.
Json = str | int | float | bool | None | list["Json"] | dict[str, "Json"]


class Terminated(TypedDict, total=False):
    """A container's ``state.terminated`` (or ``lastState.terminated``)."""

    exitCode: int
    reason: str
    message: str  # the termination message: the pre-flight's report and plan line
    startedAt: str
    finishedAt: str


class Waiting(TypedDict, total=False):
    """A container's ``state.waiting``."""

    reason: str  # CrashLoopBackOff, ImagePullBackOff, ...
    message: str


class Running(TypedDict, total=False):
    startedAt: str


class ContainerState(TypedDict, total=False):
    waiting: Waiting
    running: Running
    terminated: Terminated


class ContainerStatus(TypedDict, total=False):
    """One of a pod's ``initContainerStatuses`` or ``containerStatuses``."""

    name: str  # preflight, fetch, engine
    state: ContainerState
    lastState: ContainerState
    restartCount: int
    ready: bool  # passes its readiness probe now


class PodCondition(TypedDict, total=False):
    type: str  # PodScheduled, Ready, ...
    status: str  # "True", "False", "Unknown"
    reason: str
    message: str
    lastTransitionTime: str


class PodStatus(TypedDict, total=False):
    """A pod's ``status``, as the operator's pod index keeps it."""

    phase: str
    startTime: str  # when the kubelet took the pod
    conditions: list[PodCondition]
    initContainerStatuses: list[ContainerStatus]
    containerStatuses: list[ContainerStatus]


class PodEntry(TypedDict, total=False):
    """What the operator's pod index keeps of one serving pod (``handlers.pods_index``):
    its name and status, and for a LeaderWorkerSet's pod its group and worker indexes."""

    name: str
    status: PodStatus
    group: str | None
    worker: str | None


class DeploymentEntry(TypedDict, total=False):
    """What the operator's Deployment index keeps of a service's Deployment
    (``handlers.deployments_by_service``): its ``metadata.generation``, the resource's
    generation it was applied from (``rollout.APPLIED_GENERATION``) and its ``status``
    (``observedGeneration``, ``replicas``, ``updatedReplicas``, ``availableReplicas``)."""

    generation: int | None
    applied: str | None
    status: dict[str, Json]


class Condition(TypedDict, total=False):
    """One of the resource's ``status.conditions`` (``MemoryBudget``, ``Ready``,
    ``Degraded``)."""

    type: str
    status: str  # "True", "False", "Unknown"
    reason: str
    message: str
    observedGeneration: int
    lastTransitionTime: str


class GroupPod(TypedDict):
    """One pod of a multi-node service, as ``status.pods`` lists it."""

    name: str
    group: int
    role: str  # leader, worker
    phase: str
    ready: bool


class ModelRecord(TypedDict, total=False):
    """``status.model``: the hub model the pods' cache was sized for."""

    uri: str
    downloadBytes: int


class Startup(TypedDict):
    """``status.startup``: the start of the pod that became ready last, measured from its
    status's timestamps (``controller/startup.py``)."""

    readyAt: str
    seconds: dict[str, int]  # total, preflight, fetch, engine: those it could measure


class ServiceStatus(TypedDict, total=False):
    """``status`` of an InferenceService: what ``compute_status`` writes (a field set to
    None is removed by the merge patch)."""

    endpoint: str
    url: str  # the endpoint, where KServe's InferenceService has it
    address: dict[str, str]  # {"url": the endpoint}, KServe's (Knative's Addressable)
    replicas: int  # the scale subresource's
    readyReplicas: int
    updatedReplicas: int  # the Deployment's pods of the current spec (``rollout.py``)
    selector: str  # the scale subresource's label selector
    observedGeneration: int
    conditions: list[Condition]
    plan: dict[str, Json]  # the pre-flight's plan line in camelCase (``plan_status``)
    model: ModelRecord | None
    pods: list[GroupPod] | None
    startup: Startup
    nodeKeySecret: str  # a multi-node group's key Secret (``children.node_key_secret``)
