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


# a tiny ListOps protocol: 2 layers of width 16 on 64 generated examples cut to 128 tokens, 4 steps
TINY_LISTOPS = ["--task", "listops", "--preset", "smoke", "--quiet", "--set", "data.size=64", "data.max_len=128",
                "model.dim=16", "model.ffn_dim=32", "train.steps=4", "train.eval_every=2"]
# MiTA's options in those runs: m = 8 landmarks, k = 8 keys per expert
TINY_MITA = ["attn.landmarks=8", "attn.topk=8"]


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tiny finished full-attention run and one MiTA run (lra-run in-process), trained once per
    session: {"full": folder, "mita": folder, "data": the data folder, "root": their parent}."""
    from lra.cli import call, run as lra_run

    root = tmp_path_factory.mktemp("tiny_runs")
    (root / "data").mkdir()
    runs = {"data": root / "data", "root": root}
    for attn, extra in (("full", []), ("mita", TINY_MITA)):
        argv = [*TINY_LISTOPS, *extra, "--attn", attn, "--data-dir", str(root / "data"), "--out", str(root / "runs")]
        assert call("lra-run", lra_run.main, argv) == 0
        runs[attn] = root / "runs" / f"listops_{attn}_smoke_seed0"
    return runs
