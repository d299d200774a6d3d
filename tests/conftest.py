"""Shared test helpers, and one rule for every test: no test reaches the network."""
from __future__ import annotations

import os
import tarfile
from pathlib import Path

# Triton's interpreter runs the Triton kernels on CPU tensors (tests/test_grouped_triton.py). Triton
# reads TRITON_INTERPRET once, when triton is first imported, so it is set here, before any test
# module imports anything; `TRITON_INTERPRET=0 pytest` turns it off (those tests then skip)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lra.config import DataConfig  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the network: the hub fallback must see an offline machine."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: a scale-free comparison for outputs and gradients."""
    got, ref = got.detach(), ref.detach()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def lengths_mask(lengths: list, n: int) -> torch.Tensor:
    """[B, N] bool, True for the first lengths[b] positions of row b."""
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def cfg(root: Path, max_len: int = 0) -> DataConfig:
    """The data config of a loader test: files under ``root``."""
    return DataConfig(data_dir=str(root), max_len=max_len)


def make_tar(root: Path, folder: str, archive: str) -> Path:
    """``root/archive``, a .tar.gz of ``root/folder`` as the official downloads pack it."""
    with tarfile.open(root / archive, "w:gz") as tar:
        tar.add(root / folder, arcname=folder)
    return root / archive


def bump_mtime(path: Path) -> None:
    """Move a file's mtime forward a second: a changed source for the cache key."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def fail_if_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("the sources were read again instead of the cache")
