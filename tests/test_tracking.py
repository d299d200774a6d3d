"""train.tracker: TensorBoard's event file and an offline wandb run hold the scalars of metrics.jsonl,
read back with each tool's own reader, each logged step once after any number of stops and resumes;
the tracker is not part of a run's identity."""
from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

import lra.run.loop

from conftest import TINY_LISTOPS

# log lines at 2, 4, 6, 8; evaluations at 4 and 8
SETS = ["train.steps=8", "train.eval_every=4", "train.log_every=2", "train.threads=1"]


def metrics(run_dir: Path) -> Dict[str, Dict[int, float]]:
    """metrics.jsonl as {scalar: {step: value}}."""
    out: Dict[str, Dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step":
                out.setdefault(key, {})[row["step"]] = value
    return out


def train(cli: Callable, out: Path, data: Path, tracker: str, *extra: str) -> Path:
    ran = cli("lra-run", *TINY_LISTOPS, "--attn", "full", "--data-dir", data, "--out", out,
              "--set", *SETS, f"train.tracker={tracker}", *extra)
    assert ran.code == 0, ran.err
    return out / "listops_full_smoke_seed0"


def test_tensorboard_event_file_holds_the_metrics(cli: Callable, tmp_path: Path, listops_data: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard package is an optional extra ([track])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = train(cli, tmp_path / "runs", listops_data, "tensorboard")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    expected = metrics(run_dir)
    assert set(logged) == {"loss", "lr", "tokens_per_s", "val_acc", "val_loss", "test_acc"}
    for tag in ("loss", "lr", "val_acc", "val_loss"):
        assert logged[tag] == pytest.approx(expected[tag], rel=1e-6), tag
    record = json.loads((run_dir / "record.json").read_text())
    assert logged["test_acc"] == pytest.approx({8: record["test_acc"]})
    assert all(v > 0 for v in logged["tokens_per_s"].values()) and sorted(logged["tokens_per_s"]) == [2, 4, 6, 8]


def wandb_history(run_dir: Path) -> List[Dict[str, float]]:
    """The history rows of the offline run in ``run_dir``/wandb, every attempt's in order (a resumed
    offline run is one folder per attempt, named by its start time)."""
    paths = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert paths, f"no offline wandb run in {run_dir}"
    return [row for path in paths for row in wandb_file_rows(path)]


def wandb_file_rows(path: Path) -> List[Dict[str, float]]:
    """The history rows of one .wandb file: a LevelDB-style log (32 KiB blocks of records: crc32,
    length, type) after a 7-byte W&B header, each record one protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    payloads, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            payloads.append(pending)
    rows = []
    for payload in payloads:
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_offline_wandb_run_holds_the_metrics(cli: Callable, tmp_path: Path, listops_data: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the wandb package is an optional extra ([track])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = train(cli, tmp_path / "runs", listops_data, "wandb")
    rows = wandb_history(run_dir)
    by_step: Dict[int, Dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(int(row["_step"]), {}).update(row)
    expected = metrics(run_dir)
    for tag in ("loss", "val_acc"):
        assert {s: r[tag] for s, r in by_step.items() if tag in r} == pytest.approx(expected[tag], rel=1e-6)
    assert by_step[8]["test_acc"] == pytest.approx(json.loads((run_dir / "record.json").read_text())["test_acc"])


class Killed(BaseException):
    """Stands in for SIGKILL: raised in the loop, caught by no handler of the trainer."""


# attempts of one run: stopped by SIGTERM or killed after the step named, then run to its end. With
# log lines at 2, 4, 6, 8, evaluations at 4 and 8 and checkpoints every 3 steps: a signal on a logged
# step (2) and on an unlogged one (5), a kill past a checkpoint on a logged step (4, checkpoint 3) and
# on an unlogged one (7, checkpoint 6), and a signal on the last step (8), whose resume only tests
STOPS: List[Tuple[str, Optional[int]]] = [("signal", 2), ("kill", 4), ("signal", 5), ("kill", 7), ("signal", 8),
                                          ("end", None)]


def train_with_stops(cli: Callable, monkeypatch: pytest.MonkeyPatch, out: Path, data: Path, tracker: str) -> Path:
    """The run of ``train``, stopped and resumed as STOPS says; the run folder."""
    after_step = lra.run.loop.after_step
    for how, at in STOPS:

        def stop_after(run: object, state: object, loss: float, bar: object, stop: object, how: str = how,
                       at: object = at) -> None:
            after_step(run, state, loss, bar, stop)
            if state.step == at:  # type: ignore[attr-defined]
                if how == "kill":
                    raise Killed(f"killed after step {at}")
                os.kill(os.getpid(), signal.SIGTERM)

        with monkeypatch.context() as patch:
            patch.setattr(lra.run.loop, "after_step", stop_after)
            try:
                ran = cli("lra-run", *TINY_LISTOPS, "--attn", "full", "--data-dir", data, "--out", out,
                          "--set", *SETS, "train.checkpoint_every=3", f"train.tracker={tracker}")
            except Killed:
                ran = None
        expected = {"signal": 130, "end": 0, "kill": None}[how]
        assert (ran.code if ran else None) == expected, ran.err if ran else how
        # each attempt's event file and offline wandb folder is named by the second it started in
        time.sleep(1.1)
    return out / "listops_full_smoke_seed0"


def assert_each_step_once(logged: Dict[str, List[Tuple[int, float]]], run_dir: Path) -> None:
    """Every scalar of metrics.jsonl at each of its steps, once; tokens_per_s at each log step;
    test_acc once, at the last step."""
    expected = metrics(run_dir)
    for tag in ("loss", "lr", "val_acc", "val_loss"):
        steps = [step for step, _ in logged[tag]]
        assert sorted(steps) == sorted(expected[tag]), (tag, steps)
        assert dict(logged[tag]) == pytest.approx(expected[tag], rel=1e-6), tag
    assert sorted(step for step, _ in logged["tokens_per_s"]) == sorted(expected["loss"])
    record = json.loads((run_dir / "record.json").read_text())
    assert logged["test_acc"] == [(8, pytest.approx(record["test_acc"]))]


def test_tensorboard_holds_each_step_once_after_stops_and_resumes(
    cli: Callable, tmp_path: Path, listops_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard package is an optional extra ([track])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = train_with_stops(cli, monkeypatch, tmp_path / "runs", listops_data, "tensorboard")
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == len(STOPS)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert_each_step_once(logged, run_dir)


def test_wandb_holds_each_step_once_after_stops_and_resumes(
    cli: Callable, tmp_path: Path, listops_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="the wandb package is an optional extra ([track])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = train_with_stops(cli, monkeypatch, tmp_path / "runs", listops_data, "wandb")
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == len(STOPS)
    logged: Dict[str, List[Tuple[int, float]]] = {}
    for row in wandb_history(run_dir):
        for tag, value in row.items():
            if not tag.startswith("_"):
                logged.setdefault(tag, []).append((int(row["_step"]), value))
    assert_each_step_once(logged, run_dir)


def test_the_tracker_is_not_part_of_a_runs_identity(cli: Callable, tmp_path: Path, listops_data: Path) -> None:
    from lra.run.folder import same_run
    from lra.config import resolve

    plain = resolve("listops", "full", "smoke")
    tracked = resolve("listops", "full", "smoke", ["train.tracker=tensorboard"])
    assert same_run(plain.to_dict(), tracked)


def test_an_unknown_tracker_is_one_line(cli: Callable, tmp_path: Path) -> None:
    ran = cli("lra-run", *TINY_LISTOPS, "--attn", "full", "--out", tmp_path, "--set", "train.tracker=mlflow")
    assert ran.code == 2 and "train.tracker must be one of none, tensorboard, wandb" in ran.err
    assert list(tmp_path.iterdir()) == []
