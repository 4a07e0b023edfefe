"""What a pod serving one model over N GPUs needs beyond one GPU's pod (tensor
parallelism, N > 1): ``--tensor-parallel-size N`` for the pre-flight (which plans per GPU)
and the engine alike (``spec._engine_config``), ``nvidia.com/gpu: N``, and a memory-backed
``/dev/shm``: a container's default is 64 MiB, and NCCL falls back to shared memory between
the ranks' processes where GPUs have no peer-to-peer path (and torch's workers pass
tensors through it).

A pod's ranks run on one node: ``MAX_GPUS`` is the most a node has (an 8-GPU HGX/DGX);
across nodes, ``spec.nodes`` pods of ``gpus`` GPUs each form a LeaderWorkerSet group
(``render_group``).
"""

from __future__ import annotations

from typing import Any

from kvledger.engine.planner.estimates import NCCL_BYTES_PER_RANK, MiB

MAX_GPUS = 8
SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
# Beyond NCCL's buffers: torch.distributed's and the Python workers' own segments.
SHM_BASE_BYTES = 512 * MiB


def tensor_parallel_size(gpus: int) -> int:
    """The ranks a pod of ``gpus`` GPUs runs: one per GPU (1 on the CPU)."""
    return max(1, gpus)


def shm_size_limit(gpus: int) -> str:
    """``/dev/shm``'s ``sizeLimit``: every rank's NCCL buffers (``NCCL_BYTES_PER_RANK``, as
    the planner counts them) plus ``SHM_BASE_BYTES``, in whole MiB. It is the pod's memory
    (a memory-backed emptyDir counts against the container's limit)."""
    return f"{(NCCL_BYTES_PER_RANK * gpus + SHM_BASE_BYTES) // MiB}Mi"


def shm_volume(gpus: int) -> list[dict[str, Any]]:
    """The pod's memory-backed ``/dev/shm`` volume, for more than one GPU; else none."""
    if gpus <= 1:
        return []
    return [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                              "sizeLimit": shm_size_limit(gpus)}}]


def shm_mount(gpus: int) -> list[dict[str, Any]]:
    """The engine container's mount of that volume at /dev/shm."""
    return [{"name": SHM_VOLUME, "mountPath": SHM_PATH}] if gpus > 1 else []
