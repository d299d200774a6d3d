"""DistributedDataParallel set-up for ``torchrun``: gloo on the CPU, nccl on GPUs.

Without torchrun (no WORLD_SIZE in the environment) everything here is a no-op for one process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from ..errors import UserError
from ..files import WriteError

T = TypeVar("T")


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
        backend = "nccl" if device.type == "cuda" else "gloo"
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart == "0":
            dist.init_process_group(backend=backend)
        else:
            # an elastic restart (torchrun --max-restarts) reuses torchrun's store, which still holds the
            # addresses the workers of the attempt before published under the same keys; gloo may read
            # those and fail ("connectFullMesh failed ... Connection refused") or wait: keys of its own
            store, rank, world = next(dist.rendezvous("env://"))
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"lra-attempt-{restart}", store),
                                    rank=rank, world_size=world)
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


def teardown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def exit_status(err: Optional[BaseException]) -> int:
    """The status lra-run exits with on ``err`` (0: none): 2 bad input, 1 a run stopped, 130 Ctrl-C."""
    if err is None:
        return 0
    if isinstance(err, KeyboardInterrupt):
        return 130
    return 2 if isinstance(err, UserError) and not isinstance(err, WriteError) else 1


def on_main(fn: Callable[[], T], d: Dist) -> Optional[T]:
    """``fn()`` on rank 0 only (None on the others, which wait for it). When it raises, rank 0 raises
    it (its one error line says why) and the other ranks exit at once with the same status and no
    word of their own, instead of waiting in their next collective or failing on a lost connection."""
    if not d.enabled:
        return fn()
    result: Optional[T] = None
    failure: Optional[BaseException] = None
    if d.main:
        try:
            result = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below, once the others know
            failure = err
    status = [exit_status(failure)]
    dist.broadcast_object_list(status, src=0)
    if failure is not None:
        raise failure
    if status[0]:
        raise SystemExit(status[0])
    return result
