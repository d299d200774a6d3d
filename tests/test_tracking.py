"""train.tracker: TensorBoard's event file and an offline wandb run hold the scalars of metrics.jsonl,
read back with each tool's own reader; the tracker is not part of a run's identity."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Dict, List

import pytest

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
    """The history rows of the offline run in ``run_dir``/wandb: its .wandb file is a LevelDB-style log
    (32 KiB blocks of records: crc32, length, type) after a 7-byte W&B header, each record one protobuf
    ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
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
