"""Single process or DDP under torchrun, with the same training code.

`setup_distributed()` reads torchrun's WORLD_SIZE / LOCAL_RANK: one process -> `Dist()` on CPU
(or cuda:0 when present); several -> a process group (nccl on GPU, gloo on CPU) and one device
per process. Only rank 0 logs, evaluates and saves; `all_sum` combines per-rank step metrics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed() -> Dist:
    """Single process, or DDP when launched by torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():  # long timeout: rank 0 may generate replies for hours
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=12))
        return Dist(dist.get_rank(), world, device)
    return Dist(0, 1, device)


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def all_sum(d: Dist, x: float) -> float:
    if d.world == 1:
        return x
    import torch.distributed as dist

    t = torch.tensor(float(x), device=d.device)
    dist.all_reduce(t)
    return float(t)


def wrap_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """DDP without per-forward buffer sync: the head's buffers are frozen target weights."""
    import inspect

    DDP = torch.nn.parallel.DistributedDataParallel
    newer = "forward_sync_buffers" in inspect.signature(DDP).parameters  # torch >= 2.13
    return DDP(module, **{"forward_sync_buffers" if newer else "broadcast_buffers": False})
