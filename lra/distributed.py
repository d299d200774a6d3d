"""DistributedDataParallel set-up for ``torchrun``: gloo on the CPU, nccl on GPUs.

Without torchrun (no WORLD_SIZE in the environment) everything here is a no-op for one process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device: torch.device) -> Dist:
    """Join the torchrun process group if there is one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def all_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum a small tensor over processes (identity for one process)."""
    if d.enabled:
        values = values.clone()
        dist.all_reduce(values)
    return values


def any_flag(flag: bool, d: Dist, device: torch.device) -> bool:
    """True on every process when ``flag`` is True on any of them."""
    if not d.enabled:
        return flag
    return bool(all_sum(torch.tensor([float(flag)], device=device), d).item() > 0)


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()
