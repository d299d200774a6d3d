"""Shared test helpers, and one rule for every test: no test reaches the network."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import sys
import tarfile
import tomllib
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator

# Triton's interpreter runs the Triton kernels on CPU tensors (tests/test_grouped_triton.py). Triton
# reads TRITON_INTERPRET once, when triton is first imported, so it is set here, before any test
# module imports anything; `TRITON_INTERPRET=0 pytest` turns it off (those tests then skip)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import lra.run.loop  # noqa: E402
from lra.cli import call  # noqa: E402
from lra.config import DataConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the network: the hub fallback must see an offline machine."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def torch_threads() -> None:
    """A run in this process sets torch's thread count (train.threads): give the next test torch's setting back."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends a test loads from a file (--attn-module) are forgotten after it; the built-ins are loaded
    first, into the real registry."""
    from attentions import list_attentions, registry

    list_attentions()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_loaded_files", dict(registry._loaded_files))


# ---- the command lines, in this process ----

def console_scripts() -> Dict[str, str]:
    """pyproject.toml's [project.scripts]: command name -> "module:function"."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def command_main(prog: str) -> Callable:
    """The ``main(argv)`` of the module whose entry function the console script ``prog`` runs."""
    module, _ = console_scripts()[prog].split(":")
    return importlib.import_module(module).main


@dataclass
class Ran:
    """What a command left: its exit status and what it wrote to stdout and stderr."""
    code: int
    out: str
    err: str


# the warnings a fresh interpreter does not print (Python's default filters)
SILENT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


@pytest.fixture
def cli(capfd: pytest.CaptureFixture) -> Callable[..., Ran]:
    """``cli(prog, *args)``: run command ``prog`` in this process as its console script would
    (lra.cli.call: user errors as one stderr line and status 2, argparse's exits as their status), in
    the current folder. A warning it raises is counted as the stderr line a real process would print."""
    def run(prog: str, *args: object) -> Ran:
        main = command_main(prog)
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = call(prog, main, [str(a) for a in args])
        out, err = capfd.readouterr()
        shown = [w for w in caught if not issubclass(w.category, SILENT)]
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in shown)
        return Ran(code, out, err)
    return run


# ---- the smoke preset's ListOps set, generated once ----

def smoke_listops() -> tuple:
    """The smoke preset's generated ListOps set: (its folder name, its size), e.g. ("listops_n256_seed0", 256)."""
    from lra.config import resolve
    from lra.tasks import get_task

    data = resolve("listops", "full", "smoke").data
    return get_task("listops").folder_name(data), data.size


@pytest.fixture(scope="session")
def listops_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder holding the smoke preset's generated ListOps set, made once per session: for tests
    that need some ListOps data (pass it as --data-dir or data.data_dir=). Runs add their token caches
    to its .cache; nothing else may change it (copy_listops gives a folder of one's own)."""
    from lra.tasks.listops_gen import generate_files

    root = tmp_path_factory.mktemp("listops-data")
    name, size = smoke_listops()
    generate_files(root / name, size=size)
    return root


def copy_listops(listops_data: Path, to: Path) -> Path:
    """``to``, a new data folder with a copy of the session's smoke ListOps set (no token caches)."""
    name, _ = smoke_listops()
    shutil.copytree(listops_data / name, to / name, ignore=shutil.ignore_patterns(".lock"))
    return to


def load_script(name: str) -> types.ModuleType:
    """scripts/<name>.py imported as module ``name`` (registered in sys.modules: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: a scale-free comparison for outputs and gradients."""
    got, ref = got.detach(), ref.detach()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def same_both_ways(first: Callable[[torch.Tensor], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor],
                   x: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether two calls on x (a kernel's eager Function and its operator) give the same output and the
    same gradient for ``grad``, bit for bit."""
    results = []
    for call in (first, second):
        t = x.clone().requires_grad_()
        y = call(t)
        y.backward(grad)
        results.append((y.detach(), t.grad))
    return torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


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


@pytest.fixture(scope="session")
def debug_sweep(tmp_path_factory: pytest.TempPathFactory, listops_data: Path) -> Path:
    """2 backends x 2 seeds of lra-sweep's tiny protocol (tests/sweep_helpers.py) through the in-process
    executor, once per session: the reference the other executors' sweeps must equal."""
    from lra.sweep.cli import main
    from sweep_helpers import sweep_flags

    out = tmp_path_factory.mktemp("debug-sweep") / "sw"
    assert call("lra-sweep", main, ["run", *sweep_flags(listops_data), "--executor", "debug", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def executor_grid(tmp_path_factory: pytest.TempPathFactory, listops_data: Path) -> Path:
    """sweep_helpers.executor_flags' grid through the in-process executor, once per session: the
    records the local and SLURM executors' runs of it must equal."""
    from lra.sweep.cli import main
    from sweep_helpers import executor_flags

    out = tmp_path_factory.mktemp("executor-grid") / "sw"
    assert call("lra-sweep", main, ["run", *executor_flags(listops_data), "--executor", "debug", "--out", str(out)]) == 0
    return out


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing in the trainer handles it."""


@contextlib.contextmanager
def killed_at_step(monkeypatch: pytest.MonkeyPatch, step: int) -> Iterator[pytest.MonkeyPatch]:
    """A run started inside dies (raises Killed) when it reaches optimizer step ``step`` (0-based),
    as a kill would: its checkpoints so far stay, nothing after them is written. Yields the patch
    (for a chdir); the block must end in that death."""
    lr_at = lra.run.loop.lr_at

    def dies(at: int, cfg: object) -> float:
        if at == step:
            raise Killed
        return lr_at(at, cfg)

    with monkeypatch.context() as patch:
        patch.setattr(lra.run.loop, "lr_at", dies)
        with pytest.raises(Killed):
            yield patch
