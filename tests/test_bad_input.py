"""Bad input, one table: every case exits with status 2 and one stderr line that names what is wrong,
without a traceback, and leaves every file as it was (``.lock`` files aside: taking a lock writes
the holder's pid). Run in-process through the command-line entry functions."""
from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch

import lra.config
from conftest import killed_at_step
from lra.cli import run as lra_run

TINY_SETS = ["model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "data.max_len=128", "train.steps=12",
             "train.eval_every=6", "train.checkpoint_every=4", "train.log_every=2"]
RUN_FOLDER = "runs/listops_full_smoke_seed0"

# prepare(case folder, shared data folder, monkeypatch): the files a case needs, made before the snapshot
Prepare = Callable[[Path, Path, pytest.MonkeyPatch], None]


def nothing(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    return None


@dataclass
class Case:
    # the arguments; "{data}" stands for the shared data folder, "{here}" for the case's folder
    argv: List[str]
    # words the one stderr line must hold
    message: str
    prepare: Prepare = nothing
    prog: str = "lra-run"


def run_args(*sets: str, extra: tuple = ()) -> List[str]:
    return ["--task", "listops", "--attn", "full", "--preset", "smoke", "--quiet", "--out", "runs",
            "--set", *TINY_SETS, "data.data_dir={data}", *sets, *extra]


def killed_run(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, *sets: str) -> Path:
    """An unfinished run in ``folder/runs``: killed before step 6, after its checkpoint at step 4."""
    with killed_at_step(monkeypatch, 5) as patch:
        patch.chdir(folder)
        lra_run.main([a.replace("{data}", str(data_dir)) for a in run_args(*sets)])
    return folder / RUN_FOLDER


def finished_run(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(folder)
    assert lra_run.main([a.replace("{data}", str(data_dir)) for a in run_args()]) == 0


def with_checkpoint(change: Callable[[Path], None]) -> Prepare:
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        change(killed_run(folder, data_dir, monkeypatch) / "checkpoint.pt")
    return prepare


def other_shape(path: Path) -> None:
    saved = torch.load(path, weights_only=True)
    saved["model"]["encoder.tokens.weight"] = torch.zeros(5, 16)
    torch.save(saved, path)


def with_run_file(name: str, text: str) -> Prepare:
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (killed_run(folder, data_dir, monkeypatch) / name).write_text(text)
    return prepare


def held_by_another(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run folder's lock held (by this process, through a file of its own) as if by process 4242."""
    lock_as_4242(killed_run(folder, data_dir, monkeypatch))


# the lock files a case holds, closed after it
HELD: list = []


def lock_as_4242(folder: Path) -> None:
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".lock", "a+")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.truncate(0)
    handle.write("4242\n")
    handle.flush()
    HELD.append(handle)


def generation_in_use(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock_as_4242(folder / "gen" / "pathfinder32" / "curv_baseline")


LISTOPS_ROW = "( ( [MAX 2 9 ] ) )\t9"


def listops_files(train_rows: List[str], binary_val: bool = False) -> Prepare:
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        data = folder / "mine" / "listops_n256_seed0"
        data.mkdir(parents=True)
        for split in ("train", "val", "test"):
            rows = train_rows if split == "train" else [LISTOPS_ROW] * 4
            (data / f"basic_{split}.tsv").write_text("Source\tTarget\n" + "".join(r + "\n" for r in rows))
        if binary_val:
            (data / "basic_val.tsv").write_bytes(bytes(range(256)) * 4)
    return prepare


def pathfinder_files(metadata: bytes, image: bytes) -> Prepare:
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        level = folder / "mine" / "pathfinder32" / "curv_contour_length_14"
        (level / "metadata").mkdir(parents=True)
        (level / "imgs" / "0").mkdir(parents=True)
        (level / "metadata" / "0.npy").write_bytes(metadata)
        for i in range(12):
            (level / "imgs" / "0" / f"sample_{i}.png").write_bytes(image)
    return prepare


PATHFINDER_META = "".join(f"imgs/0 sample_{i}.png {i} {i % 2} 1 14 14 2 2 1 1\n" for i in range(12)).encode()

PLUGIN = """
import torch
from attentions import Attention, Taxonomy, register

@register("{name}")
class Broken(Attention):
    paper = "nobody 2026, a broken backend"
    cost = "O(N D)"
    taxonomy = Taxonomy("none", "1", "raw KV", "none", "dense")

    def forward(self, q, k, v, mask=None):
        return {body}
"""


def plugin(name: str, body: str) -> Prepare:
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (folder / "broken.py").write_text(PLUGIN.format(name=name, body=body))
    return prepare


def attn_yaml(text: str) -> Prepare:
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        configs = folder / "configs"
        shutil.copytree(lra.config.CONFIG_DIR, configs)
        (configs / "attn" / "full.yaml").write_text(text)
        monkeypatch.setattr(lra.config, "CONFIG_DIR", configs)
    return prepare


def bench_record(text: str) -> Prepare:
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (folder / "sweep").mkdir()
        (folder / "sweep" / "record.json").write_text(text)
    return prepare


def files(*names: str) -> Prepare:
    """Plain files where a command is given a folder; "records/x/record.json" is an unreadable record
    (lra-table would print a line skipping it, were it read before the arguments are checked)."""
    def prepare(folder: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text('{"status": ')
    return prepare


def pickled_object(path: Path) -> None:
    path.write_bytes(pickle.dumps(Path("not a checkpoint")))


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def bad_malloc_tuning(here: Path, data: Path, patch: pytest.MonkeyPatch) -> None:
    patch.setenv("LRA_MALLOC_TUNING", "yes")


CASES: Dict[str, Case] = {
    # config values, each with its valid range in the message
    "lr-nan": Case(run_args("train.lr=nan"), "train.lr must be a positive, finite number, got nan"),
    "malloc-tuning-run": Case(run_args(), "LRA_MALLOC_TUNING='yes': use 0", bad_malloc_tuning),
    "malloc-tuning-bench": Case(["attention", "--attn", "full", "--lengths", "1k", "--out", "b"],
                                "LRA_MALLOC_TUNING='yes': use 0", bad_malloc_tuning, prog="lra-bench"),
    "lr-inf": Case(run_args("train.lr=.inf"), "train.lr must be a positive, finite number, got inf"),
    "lr-zero": Case(run_args("train.lr=0"), "train.lr must be a positive"),
    "log-every-0": Case(run_args("train.log_every=0"), "train.log_every must be 1 to 100,000,000, got 0"),
    "eval-every-0": Case(run_args("train.eval_every=0"), "train.eval_every must be 1 to 100,000,000, got 0"),
    "checkpoint-every-negative": Case(run_args("train.checkpoint_every=-1"), "train.checkpoint_every must be 0 (only at the end) to 100,000,000"),
    "eval-batches-negative": Case(run_args("train.eval_batches=-1"), "train.eval_batches must be 0 (all) to 100,000,000, got -1"),
    "test-batches-negative": Case(run_args("train.test_batches=-2"), "train.test_batches must be 0 (all) to 100,000,000"),
    "threads-negative": Case(run_args("train.threads=-1"), "train.threads must be 0 (torch's default) to 1,024, got -1"),
    "warmup-negative": Case(run_args("train.warmup_steps=-5"), "train.warmup_steps must be 0 to 100,000,000, got -5"),
    "grad-clip-nan": Case(run_args("train.grad_clip=nan"), "train.grad_clip must be 0 (off) or more, finite"),
    "weight-decay-negative": Case(run_args("train.weight_decay=-0.1"), "train.weight_decay must be 0 or more"),
    "steps-negative": Case(run_args("train.steps=-1"), "train.steps must be 0 (evaluate the initial weights, no training) to 100,000,000, got -1"),
    "batch-0": Case(run_args("train.batch_size=0"), "train.batch_size must be 1 to 65,536, got 0"),
    "heads-0": Case(run_args("model.num_heads=0"), "model.num_heads must be 1 to 65,536, got 0"),
    "dim-0": Case(run_args("model.dim=0"), "model.dim must be 1 to 65,536, got 0"),
    "layers-0": Case(run_args("model.num_layers=0"), "model.num_layers must be 1 to 1,024, got 0"),
    "ffn-0": Case(run_args("model.ffn_dim=0"), "model.ffn_dim must be 1 to 1,048,576, got 0"),
    "dim-not-divisible": Case(run_args("model.num_heads=3"), "model.dim (16) must be divisible by model.num_heads (3)"),
    "dropout-1": Case(run_args("model.dropout=1.0"), "model.dropout must be in [0, 1), got 1.0"),
    "max-len-negative": Case(run_args("data.max_len=-1"), "data.max_len must be 0 (the task's default) to 1,048,576, got -1"),
    "size-negative": Case(run_args("data.size=-5"), "data.size must be 0 (the official size) to 10,000,000, got -5"),
    "data-seed-negative": Case(run_args("data.seed=-1"), "data.seed must be 0 to 4,294,967,295, got -1"),
    "workers-0": Case(run_args("data.workers=0"), "data.workers must be 1 to 1,024, got 0"),
    "seed-negative": Case(run_args(extra=("--seed", "-1")), "--seed must be 0 to 4,294,967,295, got -1"),
    "seed-not-a-number": Case(run_args(extra=("--seed", "x")), "argument --seed: invalid int value: 'x'"),
    "precision": Case(run_args("train.precision=fp8"), "train.precision must be one of auto, fp32, bf16"),
    # upper bounds, the valid range in the message
    "steps-absurd": Case(run_args("train.steps=1000000000000000"), "train.steps must be 0 (evaluate the initial weights, "
                         "no training) to 100,000,000, got 1000000000000000"),
    "batch-absurd": Case(run_args("train.batch_size=10000000"), "train.batch_size must be 1 to 65,536, got 10000000"),
    "warmup-absurd": Case(run_args("train.warmup_steps=1000000000000"), "train.warmup_steps must be 0 to 100,000,000"),
    "max-len-absurd": Case(run_args("data.max_len=100000000"), "data.max_len must be 0 (the task's default) to 1,048,576"),
    "size-absurd": Case(run_args("data.size=1000000000000"), "data.size must be 0 (the official size) to 10,000,000"),
    "layers-absurd": Case(run_args("model.num_layers=100000"), "model.num_layers must be 1 to 1,024, got 100000"),
    "dim-absurd": Case(run_args("model.dim=10000000", "model.num_heads=1"), "model.dim must be 1 to 65,536"),
    "workers-absurd": Case(run_args("data.workers=100000"), "data.workers must be 1 to 1,024, got 100000"),
    "threads-absurd": Case(run_args("train.threads=100000"), "train.threads must be 0 (torch's default) to 1,024"),
    "seed-absurd": Case(run_args(extra=("--seed", str(2**64))), "--seed must be 0 to 4,294,967,295, got 18446744073709551616"),
    # arguments checked before anything is read or written
    "run-out-is-a-file": Case(run_args(), "--out runs is a file, not a folder", files("runs")),
    "table-out-is-a-file": Case(["--runs", "records", "--out", "tables.md"], "--out tables.md is a file, not a folder",
                                files("records/x/record.json", "tables.md"), prog="lra-table"),
    "table-out-under-a-file": Case(["--runs", "records", "--out", "tables.md/new"], "--out tables.md/new: tables.md is a file",
                                   files("records/x/record.json", "tables.md"), prog="lra-table"),
    "table-reference-missing": Case(["--runs", "records", "--reference", "nowhere", "--out", "t"],
                                    "--reference nowhere: no published_lra.csv there", files("records/x/record.json"),
                                    prog="lra-table"),
    "table-throughput-is-a-file": Case(["--runs", "records", "--throughput", "sweep.json", "--out", "t"],
                                       "--throughput sweep.json is a file, not a folder",
                                       files("records/x/record.json", "sweep.json"), prog="lra-table"),
    "generate-size-absurd": Case(["generate", "listops", "--size", "1000000000000", "--data-dir", "gen"],
                                 "--size must be 0 (official size) to 10,000,000", prog="lra-data"),
    "generate-workers-absurd": Case(["generate", "listops", "--workers", "100000", "--data-dir", "gen"],
                                    "--workers 1 to 1,024; got --size 0 --seed 0 --workers 100000", prog="lra-data"),
    "generate-data-dir-is-a-file": Case(["generate", "listops", "--size", "40", "--data-dir", "gen"],
                                        "--data-dir gen is a file, not a folder", files("gen"), prog="lra-data"),
    "bench-length-absurd": Case(["attention", "--attn", "full", "--lengths", "1k,64m", "--out", "b"],
                                "--lengths: '64m' is 67,108,864 tokens; the longest is 16,777,216", prog="lra-bench"),
    "bench-batch-absurd": Case(["attention", "--attn", "full", "--lengths", "1k", "--batch", "10000000", "--out", "b"],
                               "--batch must be 1 to 65,536, got 10000000", prog="lra-bench"),
    "bench-repeats-absurd": Case(["attention", "--attn", "full", "--lengths", "1k", "--repeats", "1000000", "--out", "b"],
                                 "--repeats must be 1 to 1,000, got 1000000", prog="lra-bench"),
    "bench-budget-absurd": Case(["model", "--attn", "full", "--lengths", "1k", "--budget-s", "1e12", "--out", "b"],
                                "--budget-s must be more than 0 and at most 604,800 (a week)", prog="lra-bench"),
    "bench-out-is-a-file": Case(["attention", "--attn", "full", "--lengths", "1k", "--out", "b"], "--out b is a file, not a folder",
                                files("b"), prog="lra-bench"),
    "analyze-batch-absurd": Case(["budget", "nowhere", "--batch-size", "1000000000", "--set", "attn.topk=8"],
                                 "--batch-size must be 1 to 65,536, got 1000000000", prog="lra-analyze"),
    "analyze-examples-absurd": Case(["tokens", "nowhere", "--examples", "100000000000"],
                                    "--examples must be 1 to 10,000,000, got 100000000000", prog="lra-analyze"),
    "analyze-show-absurd": Case(["tokens", "nowhere", "--show", "1000000"], "--show must be 0 to 1,000, got 1000000",
                                prog="lra-analyze"),
    "analyze-out-is-a-file": Case(["budget", "nowhere", "--out", "a", "--set", "attn.topk=8"], "--out a is a file, not a folder",
                                  files("a"), prog="lra-analyze"),
    "attn-yaml-tasks-list": Case(run_args(), "full.yaml: 'tasks' must be a mapping of task name to options, got list",
                                 attn_yaml("tasks: [listops, text]\n")),
    "attn-yaml-task-section-list": Case(run_args(), "full.yaml: 'tasks.listops' must be a mapping",
                                        attn_yaml("tasks:\n  listops: [1, 2]\n")),
    # data files
    "listops-label-10": Case(run_args(extra=("--data-dir", "mine")), "basic_train.tsv:3: expected '<source><TAB><label 0-9>'",
                             listops_files([LISTOPS_ROW, "( [MIN 1 2 ] )\t10"])),
    "listops-label-negative": Case(run_args(extra=("--data-dir", "mine")), "basic_train.tsv:2: expected '<source><TAB><label 0-9>'",
                                   listops_files(["( [MIN 1 2 ] )\t-1"])),
    "listops-unknown-token": Case(run_args(extra=("--data-dir", "mine")), "unknown ListOps token '[AVG'",
                                  listops_files(["( [AVG 1 2 ] )\t1"])),
    "listops-binary-tsv": Case(run_args(extra=("--data-dir", "mine")), "basic_val.tsv: not a ListOps TSV file (UnicodeDecodeError",
                               listops_files([LISTOPS_ROW], binary_val=True)),
    "pathfinder-garbage-png": Case(["--task", "pathfinder", "--attn", "full", "--preset", "smoke", "--out", "runs", "--data-dir", "mine"],
                                   "sample_0.png: not a readable PNG", pathfinder_files(PATHFINDER_META, b"\x89PNG\r\n\x1a\nrubbish")),
    "pathfinder-binary-metadata": Case(["--task", "pathfinder", "--attn", "full", "--preset", "smoke", "--out", "runs", "--data-dir", "mine"],
                                       "0.npy: neither text nor a NumPy array", pathfinder_files(bytes(range(128, 256)), b"")),
    # a run folder's files
    "checkpoint-other-contents": Case(run_args(), "checkpoint.pt is not a training checkpoint of this suite (it lacks model",
                                      with_checkpoint(lambda p: torch.save({"weights": torch.zeros(2)}, p))),
    "checkpoint-pickled-object": Case(run_args(), "checkpoint.pt is unreadable (UnpicklingError)", with_checkpoint(pickled_object)),
    "checkpoint-cut": Case(run_args(), "checkpoint.pt is unreadable", with_checkpoint(cut_in_half)),
    "checkpoint-empty": Case(run_args(), "checkpoint.pt is unreadable", with_checkpoint(lambda p: p.write_bytes(b""))),
    "checkpoint-other-shape": Case(run_args(), "checkpoint.pt does not fit this run's model (Error(s) in loading state_dict "
                                   "for LRAModel: size mismatch for encoder.tokens.weight", with_checkpoint(other_shape)),
    "config-json-corrupt": Case(run_args(), "config.json is unreadable (Expecting", with_run_file("config.json", '{"task": ')),
    "config-json-list": Case(run_args(), "config.json holds a JSON list, not a run's config", with_run_file("config.json", "[]")),
    "metrics-shorter-than-checkpoint": Case(run_args(), "metrics.jsonl holds 0 bytes but the checkpoint covers",
                                            with_run_file("metrics.jsonl", "")),
    "folder-in-use": Case(run_args(), f"{RUN_FOLDER} is in use by another lra-run (pid 4242)", held_by_another),
    "resume-nothing-there": Case(run_args(extra=("--resume",)), f"--resume: no run folder {RUN_FOLDER} to resume"),
    "resume-finished": Case(run_args(extra=("--resume",)), f"--resume: the run in {RUN_FOLDER} has finished", finished_run),
    # a plugin backend that breaks the contract, named on its first call
    "plugin-wrong-shape": Case(run_args(extra=("--attn-module", "broken.py", "--attn", "badshape")),
                               "attention 'badshape' broke the contract on its first call: output shape (2, 2, 127, 8), "
                               "expected [B, H, N, D] = (2, 2, 128, 8)", plugin("badshape", "v[:, :, 1:]")),
    "plugin-wrong-dtype": Case(run_args(extra=("--attn-module", "broken.py", "--attn", "baddtype")),
                               "attention 'baddtype' broke the contract on its first call: output is float64",
                               plugin("baddtype", "v.double()")),
    "plugin-nan": Case(run_args(extra=("--attn-module", "broken.py", "--attn", "badnan")),
                       "attention 'badnan' broke the contract on its first call: non-finite output at real positions",
                       plugin("badnan", "v * float('nan')")),
    "plugin-not-a-tensor": Case(run_args(extra=("--attn-module", "broken.py", "--attn", "badtype")),
                                "forward returned tuple, not a tensor", plugin("badtype", "(v,)")),
    # lra-data
    "generate-size-negative": Case(["generate", "listops", "--size", "-5", "--data-dir", "gen"], "--size must be 0", prog="lra-data"),
    "generate-seed-negative": Case(["generate", "listops", "--seed", "-1", "--data-dir", "gen"], "--seed -1", prog="lra-data"),
    "generate-pathfinder-in-use": Case(["generate", "pathfinder32", "--size", "4", "--level", "curv_baseline", "--data-dir", "gen"],
                                       "gen/pathfinder32/curv_baseline is being generated by another process (pid 4242)",
                                       generation_in_use, prog="lra-data"),
    # lra-bench report
    "bench-record-list": Case(["report", "sweep/record.json"], "holds a JSON list, not a lra-bench record",
                              bench_record("[1, 2]"), prog="lra-bench"),
    "bench-record-lacks-fields": Case(["report", "sweep/record.json"], "the lra-bench record lacks level, hardware",
                                      bench_record('{"kind": "lra-bench"}'), prog="lra-bench"),
    "bench-record-malformed-points": Case(
        ["report", "sweep/record.json"], "a malformed lra-bench record",
        bench_record(json.dumps({"kind": "lra-bench", "level": "attention", "hardware": {}, "versions": {}, "load_average": {},
                                 "settings": {"backends": ["full"], "lengths": [1024]}, "points": [1]})), prog="lra-bench"),
    "bench-record-garbage": Case(["report", "sweep/record.json"], "cannot read a lra-bench record",
                                 bench_record("\x00\x01garbage"), prog="lra-bench"),
}


def snapshot(*roots: Path) -> Dict[str, str]:
    """Every file (but lock files) and folder under ``roots``: its content hash, or "dir"."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.name != ".lock":
                found[str(path)] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, listops_data: Path) -> Path:
    """The session's smoke ListOps set (conftest.listops_data), with the token cache of TINY_SETS made
    by one finished run: the cases read it, and must not change it."""
    with pytest.MonkeyPatch.context() as patch:
        finished_run(tmp_path_factory.mktemp("bad-input"), listops_data, patch)
    return listops_data


@pytest.fixture(autouse=True)
def release_locks(isolated_registry: None) -> None:
    """The lock files a case took are let go after it (and backends it loaded from a file forgotten)."""
    yield
    while HELD:
        HELD.pop().close()


# a warning would be a second stderr line
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(name: str, data_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, cli: Callable) -> None:
    case = CASES[name]
    case.prepare(tmp_path, data_dir, monkeypatch)
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("{data}", str(data_dir)) for a in case.argv]
    before = snapshot(tmp_path, data_dir)
    # argparse's errors too: Parser.error exits with status 2 after its one line
    proc = cli(case.prog, *argv)
    lines = proc.err.strip().splitlines()
    assert proc.code == 2, proc.err
    assert len(lines) == 1 and lines[0].startswith(f"{case.prog}: error: ") and case.message in lines[0], proc.err
    assert "Traceback" not in proc.err
    assert snapshot(tmp_path, data_dir) == before
