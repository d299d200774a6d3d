"""lra-sweep on this machine: the grid and its names, bad input, the in-process and local executors,
re-running a sweep, a run killed mid-way, and status and table."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

import pytest

from lra.run.folder import run_name
from lra.config import resolve
from lra.sweep import spec as specs
from sweep_helpers import executor_flags, outcomes, sweep_flags, wait_until

SWEEP = [sys.executable, "-c", "from lra.sweep.cli import entry; entry()"]


def test_flags_expand_to_the_runs_lra_run_names() -> None:
    spec = specs.from_flags("listops,text", "full,mita", "0,1", "smoke", ["train.lr=1e-3,3e-4", "model.num_layers=1"],
                            None, [], [])
    runs = spec.runs()
    # 2 tasks x 2 backends x 2 seeds x 2 learning rates
    assert len(runs) == 16 and len({r.key for r in runs}) == 16
    for run in runs:
        cfg = resolve(run.task, run.attn, run.preset, list(run.sets), seed=run.seed)
        assert run.name == run_name(cfg)
    assert {r.sets for r in runs} == {("train.lr=0.001", "model.num_layers=1"), ("train.lr=0.0003", "model.num_layers=1")}


def test_yaml_spec_equals_the_flags_and_adds_its_extra_runs(tmp_path: Path) -> None:
    file = tmp_path / "sweep.yaml"
    file.write_text("task: listops\nattn: [full, mita]\nseeds: [0, 1]\npreset: smoke\nset: {train.lr: [1.0e-3]}\n"
                    "extra:\n  - {task: listops, attn: mita, seed: 0, preset: smoke, set: [train.lr=1.0e-3]}\n"
                    "  - {task: listops, attn: topk, seed: 4, preset: smoke}\n")
    from_yaml = specs.from_yaml(str(file)).runs()
    from_flags = specs.from_flags("listops", "full,mita", "0,1", "smoke", ["train.lr=1.0e-3"], None, [], []).runs()
    # the first extra run is in the grid already: listed once
    assert from_yaml[:4] == from_flags and len(from_yaml) == 5
    assert from_yaml[4].name == "listops_topk_smoke_seed4" and from_yaml[4].sets == ()


def test_dry_run_lists_the_lra_run_commands_and_writes_nothing(cli: Callable, tmp_path: Path) -> None:
    ran = cli("lra-sweep", "run", "--task", "listops", "--attn", "full,mita", "--seeds", "0,1", "--preset", "smoke",
              "--out", tmp_path / "sw", "--dry-run")
    assert ran.code == 0, ran.err
    lines = ran.out.strip().splitlines()
    assert lines[-1] == "4 runs" and all(line.startswith("lra-run --task listops") for line in lines[:-1])
    assert not (tmp_path / "sw").exists()


def bad(tmp: Path) -> List[tuple]:
    spec = tmp / "spec.yaml"
    return [
        (["run", "--task", "listops", "--attn", "nope"], "unknown attention 'nope'"),
        (["run", "--task", "nolist", "--attn", "full"], "unknown task"),
        (["run", "--task", "listops", "--attn", ""], "--attn ''"),
        (["run", "--task", "listops", "--attn", "full,,mita"], "without empty items"),
        (["run", "--task", "listops", "--attn", "full", "--seeds", "0,x"], "is not a seed"),
        (["run", "--task", "listops", "--attn", "full", "--seeds", "-1"], "negative"),
        (["run", "--task", "listops", "--attn", "full", "--set", "train.lr"], "section.key=value"),
        (["run", "--task", "listops", "--attn", "full", "--set", "train.nope=1"], "nope"),
        (["run", "--task", "listops", "--attn", "full", "--preset", "fast"], "unknown preset"),
        (["run", "--attn", "full"], "needs --task and --attn"),
        (["run"], "no grid given"),
        (["run", "--spec", spec, "--task", "listops"], "not both"),
        (["run", "--spec", tmp / "none.yaml"], "no such file"),
        (["run", "--spec", spec, "--parallel", "0"], "--parallel must be at least 1"),
        (["run", "--task", "listops", "--attn", "full", "--executor", "slurm", "--parallel", "2"], "--parallel is for"),
        (["run", "--task", "listops", "--attn", "full", "--executor", "slurm", "--slurm-extra", "nosuch=1"],
         "a SLURM option submitit does not take"),
        (["run", "--task", "listops", "--attn", "full", "--executor", "slurm", "--slurm-extra", "exclude"], "KEY=VALUE"),
        (["run", "--task", "listops", "--attn", "full", "--executor", "local", "--parallel", "64"], "cores"),
        (["run", "--task", "listops", "--attn", "full", "--gpus-per-run", "1"], "GPUs; this machine has 0"),
        (["run", "--seeds", "0,1"], "needs --task and --attn"),
        (["status", tmp / "none"], "no such folder"),
        (["status", tmp], "holds no sweep"),
        (["table", tmp], "holds no sweep"),
    ]


SPECS = {
    "malformed": "task: [listops\n",
    "a list": "- listops\n",
    "unknown key": "task: listops\nattn: full\nbackends: [mita]\n",
    "no attn": "task: listops\n",
    "bad set": "task: listops\nattn: full\nset: [train.lr]\n",
    "bad extra": "extra:\n  - {task: listops}\n",
    "empty": "{}\n",
}


@pytest.mark.parametrize("case", range(23))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case: int, cli: Callable, tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text("task: listops\nattn: full\npreset: smoke\n")
    args, expected = bad(tmp_path)[case]
    if expected == "a SLURM option submitit does not take" and shutil.which("sbatch") is None:
        # submitit checks options only where SLURM is installed; elsewhere the missing sbatch is the error
        expected = "--executor slurm needs SLURM's sbatch on PATH"
    before = sorted(tmp_path.iterdir())
    out = [] if args[0] != "run" else ["--out", tmp_path / "sw"]
    ran = cli("lra-sweep", *args, *out)
    assert ran.code == 2 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert expected in ran.err and "Traceback" not in ran.err
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_bad_spec_file_is_one_line_exit_2(name: str, cli: Callable, tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(SPECS[name])
    ran = cli("lra-sweep", "run", "--spec", tmp_path / "spec.yaml", "--out", tmp_path / "sw")
    assert ran.code == 2 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert "Traceback" not in ran.err and not (tmp_path / "sw").exists()


def test_another_spec_in_a_sweep_folder_is_refused(cli: Callable, tmp_path: Path, listops_data: Path) -> None:
    out = tmp_path / "sw"
    assert cli("lra-sweep", "run", *sweep_flags(listops_data, "full", "0"), "--executor", "debug", "--out", out).code == 0
    before = (out / "sweep" / "spec.yaml").read_bytes()
    ran = cli("lra-sweep", "run", *sweep_flags(listops_data, "full", "0,1"), "--executor", "debug", "--out", out)
    assert ran.code == 2 and "holds another sweep" in ran.err
    assert (out / "sweep" / "spec.yaml").read_bytes() == before


def test_a_debug_sweep_writes_lra_run_folders_and_reports_them(debug_sweep: Path, cli: Callable) -> None:
    names = ["listops_full_smoke_seed0", "listops_full_smoke_seed1", "listops_mita_smoke_seed0", "listops_mita_smoke_seed1"]
    assert sorted(outcomes(debug_sweep)) == names
    runs = json.loads((debug_sweep / "sweep" / "runs.json").read_text())["runs"]
    assert [r["key"] for r in runs] == [f"{n}.{r['key'].split('.')[-1]}" for n, r in zip(names, runs)]
    ran = cli("lra-sweep", "status", debug_sweep)
    lines = ran.out.strip().splitlines()
    assert ran.code == 0 and lines[-1] == "4 runs: 4 finished"
    for name, line in zip(names, lines):
        acc = json.loads((debug_sweep / name / "record.json").read_text())["test_acc"]
        assert line.startswith(name) and f"finished  test acc {acc:.4f}" in line


def test_a_sweep_run_again_skips_its_finished_runs(debug_sweep: Path, cli: Callable, listops_data: Path) -> None:
    stamps = {p: p.stat().st_mtime_ns for p in debug_sweep.glob("*/record.json")}
    ran = cli("lra-sweep", "run", *sweep_flags(listops_data), "--executor", "debug", "--out", debug_sweep)
    assert ran.code == 0 and "0 to run (4 finished left as they are)" in ran.err
    # the same sweep, continued from its folder alone
    ran = cli("lra-sweep", "run", "--executor", "debug", "--out", debug_sweep)
    assert ran.code == 0 and "0 to run" in ran.err
    assert {p: p.stat().st_mtime_ns for p in debug_sweep.glob("*/record.json")} == stamps
    assert len(list(debug_sweep.glob("*_seed*"))) == 4


def test_runs_recorded_before_a_config_field_existed_count_as_finished(debug_sweep: Path, cli: Callable,
                                                                        listops_data: Path, tmp_path: Path) -> None:
    """A sweep folder written by a version whose configs lacked fields added since (inside the model and
    train sections): continuing it runs nothing again, each missing field read as its default."""
    old = tmp_path / "old"
    shutil.copytree(debug_sweep, old)
    for path in old.glob("*_seed*/config.json"):
        config = json.loads(path.read_text())
        for section, key in (("model", "qkv_dim"), ("model", "head"), ("train", "schedule"), ("train", "optimizer")):
            del config[section][key]
        path.write_text(json.dumps(config))
    stamps = {p: p.stat().st_mtime_ns for p in old.glob("*/record.json")}
    ran = cli("lra-sweep", "run", "--executor", "debug", "--out", old)
    assert ran.code == 0 and "0 to run (4 finished left as they are)" in ran.err
    assert {p: p.stat().st_mtime_ns for p in old.glob("*/record.json")} == stamps
    assert len(list(old.glob("*_seed*"))) == 4


def test_sweep_table_tabulates_its_runs(debug_sweep: Path, cli: Callable, tmp_path: Path) -> None:
    ran = cli("lra-sweep", "table", debug_sweep, "--out", tmp_path / "tables")
    assert ran.code == 0, ran.err
    text = (tmp_path / "tables" / "accuracy.md").read_text()
    assert "Runs used (4)" in text and "listops_mita_smoke_seed1" in text


def test_local_executor_runs_in_parallel_pinned_and_equals_the_debug_sweep(
    debug_sweep: Path, listops_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sw"
    proc = subprocess.run([*SWEEP, "run", *sweep_flags(listops_data), "--executor", "local", "--parallel", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert outcomes(out) == outcomes(debug_sweep)
    # each run was pinned to one core of its own
    logs = [json.loads(p.read_text()) for p in (out / "sweep" / "state").glob("*.json")]
    assert all(s["cluster"] == "local" and s["status"] == "completed" for s in logs)
    assert proc.stdout.strip().splitlines()[-1] == "4 runs: 4 finished"
    assert sorted(p.name for p in (out / "sweep" / "submitit").iterdir() if not p.name[0].isdigit()) == []


def test_the_debug_and_local_executors_give_the_same_records_at_the_same_thread_count(
    executor_grid: Path, listops_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sw"
    proc = subprocess.run([*SWEEP, "run", *executor_flags(listops_data), "--executor", "local", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(outcomes(out)) == ["listops_full_smoke_seed0", "listops_mita_smoke_seed0"]
    assert outcomes(out) == outcomes(executor_grid)


def test_a_run_killed_mid_way_fails_then_the_sweep_resumes_it_identically(
    debug_sweep: Path, listops_data: Path, tmp_path: Path, cli: Callable
) -> None:
    out = tmp_path / "sw"
    flags = sweep_flags(listops_data, "full", "0", ["train.steps=400"])
    sweep = subprocess.Popen([*SWEEP, "run", *flags, "--executor", "local", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = out / "listops_full_smoke_seed0"
    wait_until(lambda: (run_dir / "checkpoint.pt").exists() or sweep.poll() is not None, 300, "a checkpoint")
    assert sweep.poll() is None, sweep.communicate()[1][-2000:]
    ran = cli("lra-sweep", "status", out)
    assert "  running   step " in ran.out and " of 400" in ran.out, ran.out
    # the lock file names the lra-run process that holds the folder
    os.kill(int((run_dir / ".lock").read_text()), signal.SIGKILL)
    _, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 1
    ran = cli("lra-sweep", "status", out)
    assert "  failed    lra-run was killed by SIGKILL" in ran.out and "1 run: 1 failed" in ran.out, ran.out
    ran = cli("lra-sweep", "run", *flags, "--executor", "debug", "--out", out)
    assert ran.code == 0 and "1 run: 1 finished" in ran.out, ran.err
    reference = tmp_path / "reference"
    assert cli("lra-sweep", "run", *flags, "--executor", "debug", "--out", reference).code == 0
    assert outcomes(out) == outcomes(reference)


def test_status_names_pending_failed_and_diverged_runs(cli: Callable, listops_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "sw"
    spec = tmp_path / "spec.yaml"
    # text needs files the empty data folder lacks; a huge learning rate diverges
    spec.write_text(f"data_dir: {listops_data}\nextra:\n"
                    "  - {task: listops, attn: full, preset: smoke, set: [train.lr=1.0e+12, train.grad_clip=0.0, "
                    "model.dim=16, model.ffn_dim=32, data.max_len=128]}\n"
                    "  - {task: text, attn: full, preset: smoke}\n")
    ran = cli("lra-sweep", "run", "--spec", spec, "--executor", "debug", "--out", out)
    assert ran.code == 1
    lines = cli("lra-sweep", "status", out).out.strip().splitlines()
    assert "  diverged  loss became" in lines[0]
    assert "  failed    lra-run: error:" in lines[1] and f"(log: {out}/sweep/logs/text_full_smoke_seed0.log)" in lines[1]
    assert lines[-1] == "2 runs: 1 diverged, 1 failed"
    spec.write_text(spec.read_text() + "  - {task: listops, attn: mita, preset: smoke}\n")
    out2 = tmp_path / "sw2"
    from lra.sweep.folder import SweepFolder
    from lra.sweep.spec import from_yaml
    from lra.sweep.cli import run_argv

    sweep = from_yaml(str(spec))
    runs = sweep.runs()
    SweepFolder(out2).write(sweep, runs, [run_argv(str(out2), r, sweep) for r in runs])
    lines = cli("lra-sweep", "status", out2).out.strip().splitlines()
    assert all("  pending   not started" in line for line in lines[:3]) and lines[-1] == "3 runs: 3 pending"


def test_reproduce_lra_runs_its_grid_through_lra_sweep(listops_data: Path, tmp_path: Path) -> None:
    from conftest import ROOT
    from sweep_helpers import TINY_SETS

    env = {**os.environ, "TASKS": "listops", "BACKENDS": "full", "SEEDS": "0 1", "DATA_DIR": str(listops_data),
           "OUT": str(tmp_path / "runs"), "TABLES": str(tmp_path / "tables")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_lra.sh"), "smoke", "--executor", "debug",
                           "--quiet", "--set", *TINY_SETS], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.parent.name for p in (tmp_path / "runs").glob("*/record.json")) == [
        "listops_full_smoke_seed0", "listops_full_smoke_seed1"]
    assert "Runs used (2)" in (tmp_path / "tables" / "accuracy.md").read_text()


def test_a_single_string_where_a_list_is_expected_is_a_one_element_list(tmp_path: Path, cli: Callable) -> None:
    layer, module = tmp_path / "layer.yaml", tmp_path / "mine.py"
    layer.write_text("train: {steps: 3}\n")
    module.write_text("")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"task: listops\nattn: full\npreset: smoke\nconfigs: {layer}\nattn_modules: {module}\n")
    assert specs.from_yaml(str(spec)).configs == [str(layer)]
    assert specs.from_yaml(str(spec)).attn_modules == [str(module)]
    ran = cli("lra-sweep", "run", "--spec", spec, "--out", tmp_path / "sw", "--dry-run")
    assert ran.code == 0, ran.err
    assert f"--config {layer} --attn-module {module}" in ran.out and ran.out.strip().endswith("1 run")
    spec.write_text("task: listops\nattn: full\nconfigs: {a: 1}\n")
    ran = cli("lra-sweep", "run", "--spec", spec, "--out", tmp_path / "sw")
    assert ran.code == 2 and "configs must be a path or a list of paths" in ran.err


def test_a_damaged_spec_in_the_sweep_folder_is_named_without_a_flag_not_given(
    debug_sweep: Path, tmp_path: Path, cli: Callable
) -> None:
    out = tmp_path / "sw"
    shutil.copytree(debug_sweep, out)
    (out / "sweep" / "spec.yaml").write_text("task: [listops\n")
    ran = cli("lra-sweep", "run", "--executor", "debug", "--out", out)
    assert ran.code == 2 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert f"--spec {out}" not in ran.err and f"the sweep's spec {out}/sweep/spec.yaml is not readable YAML" in ran.err
    assert f"delete {out}/sweep" in ran.err


def test_status_says_a_stopped_run_resumes_from_its_checkpoint_or_restarts(
    debug_sweep: Path, tmp_path: Path, cli: Callable
) -> None:
    out = tmp_path / "sw"
    shutil.copytree(debug_sweep, out, ignore=shutil.ignore_patterns(".lock"))
    run_dir = out / "listops_full_smoke_seed0"
    (run_dir / "record.json").unlink()
    line = cli("lra-sweep", "status", out).out.splitlines()[0]
    assert "pending   stopped at step 20 of 20, before its first checkpoint; the next lra-sweep run restarts it" in line
    (run_dir / "checkpoint.pt").write_bytes(b"")
    line = cli("lra-sweep", "status", out).out.splitlines()[0]
    assert "pending   stopped at step 20 of 20; the next lra-sweep run resumes it from its last checkpoint" in line


def test_a_failed_runs_line_is_cut_between_words(tmp_path: Path) -> None:
    from lra.format import clip
    from lra.sweep.job import last_line

    log = tmp_path / "run.log"
    log.write_text("== lra-run ...\n" + "lra-run: error: " + "unreadable " * 40 + "\n")
    line = last_line(log)
    assert len(line) <= 300 and line.endswith("unreadable...") and line.startswith("lra-run: error: unreadable")
    assert clip("one two three", 9) == "one..." and clip("abcdefghijkl", 8) == "abcde..." and clip("short", 9) == "short"


def test_messages_count_one_run_as_one() -> None:
    from lra.format import plural
    from lra.sweep.status import RunStatus, summary

    assert plural(1, "run") == "1 run" and plural(2, "run") == "2 runs" and plural(0, "run") == "0 runs"
    assert summary([RunStatus("k", "k", "failed", "")]) == "1 run: 1 failed"
