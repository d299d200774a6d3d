"""train.flush_denormal: a CPU run flushes denormal floats to zero when asked, and only then."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from lra.config import resolve
from lra.run.setup import prepare

DENORMAL = 1e-39  # under float32's smallest normal number, 1.18e-38


@pytest.fixture(autouse=True)
def restore_mode() -> Iterator[None]:
    yield
    torch.set_flush_denormal(False)


def kept(x: float) -> float:
    """``x`` through one float32 operation: 0 where denormals are flushed."""
    return (torch.tensor([x], dtype=torch.float32) * 1.0).item()


@pytest.mark.parametrize("flush", [True, False])
def test_a_cpu_run_flushes_denormals_as_its_config_says(flush: bool) -> None:
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode (torch.set_flush_denormal returned False)")
    torch.set_flush_denormal(not flush)  # the other mode first: the run must set its own
    prepare(resolve("mqar", "full", "smoke", [f"train.flush_denormal={str(flush).lower()}", "train.device=cpu"]))
    assert (kept(DENORMAL) == 0.0) is flush


def test_denormals_are_kept_by_default() -> None:
    cfg = resolve("mqar", "full", "smoke")
    assert cfg.train.flush_denormal is False
