"""lra-run and lra-data from the command line: a smoke run writes a valid record; bad input is one line, exit 2.
Run in this process through the commands' entry functions (conftest.cli); one case per console script in a
fresh interpreter."""
from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from attentions import list_attentions
from conftest import console_scripts, copy_listops, smoke_listops
from lra.cli import data as lra_data, guarded, run as lra_run
from lra.machine import boot_id
from lra.run.record import validate_record


def test_smoke_run_writes_a_valid_record(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the record lands in ./runs, where the last line says; a --data-dir of
    one's own gets its ListOps set generated as ./data does; the generated files are world-readable
    (umask permitting); --quiet leaves stderr empty."""
    (tmp_path / "mydata").mkdir()
    monkeypatch.chdir(tmp_path)
    proc = cli("lra-run", "--task", "listops", "--attn", "full", "--preset", "smoke", "--data-dir", "mydata", "--quiet",
               "--set", "train.steps=4", "train.eval_every=2", "train.warmup_steps=2")
    assert proc.code == 0, proc.err
    assert proc.err == ""
    records = list((tmp_path / "runs").glob("*/record.json"))
    assert len(records) == 1
    assert proc.out.strip().endswith("record: runs/listops_full_smoke_seed0/record.json")
    assert records[0] == tmp_path / "runs" / "listops_full_smoke_seed0" / "record.json"
    generated = tmp_path / "mydata" / "listops_n256_seed0" / "basic_train.tsv"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(generated.stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(records[0].stat().st_mode) == 0o666 & ~umask
    record = json.loads(records[0].read_text())
    validate_record(record)
    assert len(record["load_average"]) == 3 and record["matmul_gflops"] > 0
    # the machine's boot: Linux has one (the efficiency table compares runs of one boot)
    assert record["boot_id"] == boot_id() and (boot_id() is not None or not Path("/proc/sys/kernel").exists())
    assert record["status"] == "completed" and record["steps"] == 4
    assert 0.0 <= record["test_acc"] <= 1.0 and 0.0 < record["majority_acc"] <= 1.0
    assert record["config"]["train"]["steps"] == 4 and record["task"] == "listops"
    assert record["train_time_s"] > 0 and record["peak_memory_mb"] > 0 and record["params"] > 0
    metrics = [json.loads(line) for line in (records[0].parent / "metrics.jsonl").read_text().splitlines()]
    assert any("val_acc" in m for m in metrics)


BAD = {
    "unknown-task": (["--task", "listopz", "--attn", "full"], "unknown task 'listopz'; known: listops"),
    "unknown-attn": (["--task", "listops", "--attn", "fulll"], "unknown attention 'fulll'; known: full"),
    "unknown-preset": (["--task", "listops", "--attn", "full", "--preset", "gpu9"], "unknown preset 'gpu9'"),
    "unknown-key": (["--task", "listops", "--attn", "full", "--set", "train.stepz=3"], "unknown key train.stepz"),
    "wrong-type": (["--task", "listops", "--attn", "full", "--set", "train.steps=many"], "train.steps must be int"),
    "no-data": (["--task", "listops", "--attn", "full", "--data-dir", "empty", "--set", "data.generate=false"],
                "lra-data generate listops --data-dir empty`, or drop --set data.generate=false"),
    "missing-dir": (["--task", "listops", "--attn", "full", "--data-dir", "nowhere"], "is not a folder"),
    "missing-arg": (["--task", "listops"], "the following arguments are required: --attn"),
    "augment-listops": (["--task", "listops", "--attn", "full", "--set", "train.augment=dihedral"],
                        "train.augment=dihedral needs a task"),
}


@pytest.mark.parametrize("args, message", BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path: Path, args: list, message: str, cli,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    proc = cli("lra-run", *args, "--out", "runs")
    assert proc.code == 2
    lines = proc.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lra-run: error: ") and message in lines[0], proc.err
    assert "Traceback" not in proc.err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["empty"]


# a bad argument of each command
CONSOLE_BAD = {
    "lra-run": (["--task", "listopz", "--attn", "full"], "unknown task 'listopz'; known: listops"),
    "lra-data": (["generate", "listops", "--size", "-5"], "--size must be 0"),
    "lra-bench": (["attention", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    "lra-table": (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    "lra-check-attn": (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    "lra-analyze": (["budget", "no-such-run", "--set", "attn.topk=8"], "no-such-run"),
    "lra-sweep": (["status", "no-such-sweep"], "no-such-sweep: no such folder"),
}


def one_error_line(prog: str, message: str, err: str) -> None:
    assert err.startswith(f"{prog}: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("prog", console_scripts())
def test_console_script_entry_bad_input_is_one_line_exit_2(prog: str, tmp_path: Path, capfd: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The function each console script of pyproject.toml runs: sys.argv in, exit status out."""
    import importlib

    module, function = console_scripts()[prog].split(":")
    args, message = CONSOLE_BAD[prog]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [prog, *args])
    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), function)()
    assert exit_.value.code == 2
    out, err = capfd.readouterr()
    one_error_line(prog, message, err)
    assert out == "" and not list(tmp_path.iterdir())


@pytest.mark.parametrize("prog", ["lra-run", "lra-data"])
def test_console_script_in_a_fresh_interpreter_bad_input_is_one_line_exit_2(prog: str, tmp_path: Path) -> None:
    """End to end: in its own interpreter, no traceback (every other command-line test runs in this process)."""
    module, function = console_scripts()[prog].split(":")
    args, message = CONSOLE_BAD[prog]
    cmd = [sys.executable, "-c", f"from {module} import {function}; {function}()", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    one_error_line(prog, message, proc.stderr)
    assert proc.stdout == "" and not list(tmp_path.iterdir())


def test_lra_data_generate_writes_official_files(tmp_path: Path, cli) -> None:
    proc = cli("lra-data", "generate", "listops", "--size", "40", "--data-dir", tmp_path)
    assert proc.code == 0, proc.err
    folder = tmp_path / "listops_n40_seed0"
    lines = (folder / "basic_train.tsv").read_text().splitlines()
    assert lines[0] == "Source\tTarget" and len(lines) == 41
    assert all((folder / f"basic_{s}.tsv").exists() for s in ("val", "test"))


def test_lra_data_generate_rerun_removes_what_a_killed_write_left(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun of `lra-data generate` removes the `.basic_train.tsv.*` temporary file an interrupted one left."""
    folder = tmp_path / "listops_n40_seed0"
    folder.mkdir()
    # what a SIGKILL during the write of basic_train.tsv leaves: its half-written temporary file
    (folder / ".basic_train.tsv.x7k2q9").write_text("Source\tTarget\n( [MAX 1")
    # and a write stopped by Ctrl-C after it made its temporary file
    from lra.tasks import listops_gen

    def interrupted(files: list, advice: str = "") -> None:
        path = files[0][0]
        (path.parent / f".{path.name}.ctrlc").write_text("partial")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(listops_gen, "write_atomic_set", interrupted)
        # the rows are never written: any will do (a real generation takes seconds)
        patch.setattr(listops_gen, "generate", lambda num_samples, **kwargs: [("[MAX 1 ]", 1)] * num_samples)
        assert guarded("lra-data", lambda: lra_data.main(["generate", "listops", "--size", "40", "--data-dir", str(tmp_path)])) == 130
    assert lra_data.main(["generate", "listops", "--size", "40", "--data-dir", str(tmp_path)]) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".lock", "basic_test.tsv", "basic_train.tsv", "basic_val.tsv"]
    assert len((folder / "basic_train.tsv").read_text().splitlines()) == 41


@pytest.mark.parametrize("attn", list_attentions())
def test_every_backend_trains_listops_smoke_through_lra_run(attn: str, listops_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    code = lra_run.main(["--task", "listops", "--attn", attn, "--preset", "smoke", "--out", str(out), "--quiet",
                         "--data-dir", str(listops_data),
                         "--set", "train.steps=3", "train.eval_every=3", "train.test_batches=1"])
    assert code == 0
    record = json.loads(next(out.glob("*/record.json")).read_text())
    assert record["attn"] == attn and record["status"] == "completed" and record["steps"] == 3
    assert record["final_train_loss"] is not None and math.isfinite(record["final_train_loss"])


def test_lra_data_check_lists_every_generated_set_with_its_size(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                               listops_data: Path) -> None:
    """`lra-data check` lists a generated listops_n<size>_seed<seed> set (with its split sizes), not MISSING."""
    name, size = smoke_listops()
    copy_listops(listops_data, tmp_path)
    # a second set, of seed 1 (its rows do not matter here)
    shutil.copytree(tmp_path / name, tmp_path / name.replace("_seed0", "_seed1"))
    capsys.readouterr()
    assert lra_data.main(["check", "--data-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("listops"))
    assert lines[at].split() == ["listops", "present", str(tmp_path / f"listops_n{size}_seed0"), "(train", str(size),
                                 "/", "val", "32", "/", "test", "32)"]
    assert lines[at + 1].split()[:2] == ["present", str(tmp_path / f"listops_n{size}_seed1")]
    assert "no set of the official size (preset paper) yet" in lines[at + 2]
    assert lines[at + 3].startswith("text ")


def test_lra_data_check_says_when_the_data_folder_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    code = guarded("lra-data", lambda: lra_data.main(["check", "--data-dir", str(tmp_path / "nowhere")]))
    err = capsys.readouterr().err
    assert code == 2 and err == f"lra-data: error: --data-dir {tmp_path / 'nowhere'} is not a folder; give the folder that holds the task files\n"
    # the default ./data not made yet (a fresh clone): said once, then every task's line
    monkeypatch.chdir(tmp_path)
    assert lra_data.main(["check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the data folder ./data does not exist yet")
    assert [line.split()[:2] for line in lines[1:3]] == [["listops", "MISSING"], ["text", "MISSING"]]


def test_every_lra_data_option_has_help_text() -> None:
    parser = lra_data.parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"lra-data {name} {action.option_strings or action.dest} has no help text"


MASK_IGNORING = """
from dataclasses import dataclass
import torch.nn.functional as F
from attentions import Attention, Taxonomy, register

@dataclass
class NoConfig:
    pass

@register("maskless")
class Maskless(Attention):
    paper = "nobody 2026, a backend that ignores the mask"
    cost = "O(N^2 D)"
    Config = NoConfig
    taxonomy = Taxonomy("none", "1", "raw KV", "none", "dense")

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v)
"""


@pytest.mark.usefixtures("isolated_registry")
def test_lra_run_warns_of_a_backend_that_fails_the_mask_check(tmp_path: Path) -> None:
    from attentions import load_attention_module

    (tmp_path / "maskless.py").write_text(MASK_IGNORING)
    load_attention_module(str(tmp_path / "maskless.py"))
    warning = lra_run.mask_warning("maskless")
    assert warning.startswith("attention 'maskless' fails lra-check-attn's padding check (output at real positions changed")
    assert "\n" not in warning
    assert all(lra_run.mask_warning(name) == "" for name in list_attentions() if name != "maskless")
