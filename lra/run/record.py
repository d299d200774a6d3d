"""The result record: one JSON file per run, the source of every table.

The fields of :class:`Record` are the schema: its keys, their order in record.json and their
types, read by ``validate_record`` too. Keys are stable; a new version only adds keys, each with a
default, so every older record still reads.

Versions (the record's ``schema`` key):
  1  the fields from ``status`` to ``message``, and any of ``load_average``, ``init_from``,
     ``matmul_gflops``, ``allocator``, ``boot_id`` (a missing one reads as null); ``git_commit`` may
     name the code the run ended on rather than the code it started from.
  2  every field below, each written (null where it does not apply); ``git_commit`` is the code the
     run started from ("A -> B" when it was resumed on other code).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

SCHEMA_VERSION = 2
# the schema versions this code reads
SCHEMA_VERSIONS = (1, 2)
STATUSES = ("completed", "diverged", "running")


@dataclass
class Record:
    # "completed" | "diverged" | "running" (a checkpointed run not yet finished)
    status: str
    # folder name of the run under ``out``
    run_name: str
    task: str
    attn: str
    preset: str
    seed: int
    # the resolved RunConfig (model / train / data / attn_options)
    config: Dict[str, Any]
    # keys one query attends to, from the backend (e.g. "m + k = 128")
    attn_budget: str
    # optimizer steps taken
    steps: int
    # step of the best validation accuracy (the checkpoint tested)
    best_step: int
    # best validation accuracy (fraction, 0-1); None before any evaluation
    val_acc: Optional[float]
    # test accuracy of the best-validation checkpoint (fraction); None when the run did not complete
    test_acc: Optional[float]
    # accuracy of always predicting the test split's most common label (fraction)
    majority_acc: Optional[float]
    # test examples evaluated (the whole split unless train.test_batches limits it)
    test_examples: int
    # mean training loss over the last logging window
    final_train_loss: Optional[float]
    # wall-clock seconds of training steps (evaluation excluded), summed over resumes
    train_time_s: Optional[float]
    # wall-clock seconds spent evaluating
    eval_time_s: Optional[float]
    # training tokens (padded length x batch) per second of train_time_s
    tokens_per_s: Optional[float]
    # peak memory: CUDA max_memory_allocated, or the process's peak RSS on the CPU
    peak_memory_mb: Optional[float]
    # "cuda_max_allocated" | "cpu_peak_rss"
    memory_kind: str
    # trainable parameters
    params: int
    # where it ran (lra.machine.environment); git_commit: the code the run started from ("A -> B"
    # when it was resumed on other code)
    device: str
    device_name: str
    torch: str
    python: str
    git_commit: str
    hostname: str
    world_size: int
    # "fp32" | "bf16"
    precision: str
    # ISO-8601 UTC
    started_at: str
    finished_at: Optional[str]
    # why the run stopped, when it did not complete
    message: str
    # the machine's 1, 5 and 15 minute load averages when training ended (the run's own threads
    # included)
    # The fields from here on have defaults: a version 1 record may lack any of them.
    load_average: Optional[List[float]] = None
    # the run whose best weights this one started from (lra-run --init-from; None = a fresh start):
    # its folder name ("run"), "attn", "attn_budget", "attn_options", "test_acc", and the tensors
    # "loaded" (a count) and left "new" (their names)
    init_from: Optional[Dict[str, Any]] = None
    # float32 matmul rate (GFLOP/s, 1024 x 1024, the run's thread count) measured when training
    # ended, beside the load: tells apart machines of the same name
    matmul_gflops: Optional[float] = None
    # the C allocator's setting during training (lra/machine/allocator.py)
    allocator: Optional[str] = None
    # the machine's boot (lra.machine.boot_id) when training ended: equal ids, one machine in one boot
    boot_id: Optional[str] = None
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object: ``schema`` first, then the fields in their order."""
        data = dataclasses.asdict(self)
        return {"schema": data.pop("schema"), **data}


# every key a record of any version must have: the fields without a default (``schema`` too)
RECORD_KEYS = ("schema",) + tuple(f.name for f in dataclasses.fields(Record) if f.default is dataclasses.MISSING)
# the keys version 2 adds to what it requires: every field
RECORD_KEYS_V2 = RECORD_KEYS + tuple(f.name for f in dataclasses.fields(Record) if f.name not in RECORD_KEYS)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_problem(value: Any, kind: Any) -> Optional[str]:
    """What ``value`` should have been, when it does not match the field type ``kind``; else None."""
    if typing.get_origin(kind) is typing.Union:
        if value is None:
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
        optional = " or null"
    else:
        optional = ""
    origin = typing.get_origin(kind)
    if kind is float and not _is_number(value):
        return "a number" + optional
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        return "a whole number" + optional
    if kind is str and not isinstance(value, str):
        return "a string" + optional
    if origin is dict and not isinstance(value, dict):
        return "an object" + optional
    if origin is list and not (isinstance(value, list) and all(_is_number(x) for x in value)):
        return "a list of numbers" + optional
    return None


def validate_record(record: Dict[str, Any]) -> None:
    """Raise ValueError naming the first missing key or ill-typed value (used by tests and by lra-table)."""
    schema = record.get("schema")
    if "schema" in record and schema not in SCHEMA_VERSIONS:
        raise ValueError(f"record schema is {schema!r:.40}; this version reads {', '.join(map(str, SCHEMA_VERSIONS))}")
    missing = [k for k in (RECORD_KEYS_V2 if schema == 2 else RECORD_KEYS) if k not in record]
    if missing:
        raise ValueError(f"record is missing {', '.join(missing)}")
    if record["status"] not in STATUSES:
        raise ValueError(f"record status is {record['status']!r}; expected one of {', '.join(STATUSES)}")
    hints = typing.get_type_hints(Record)
    for f in dataclasses.fields(Record):
        if f.name not in record:
            continue
        problem = _type_problem(record[f.name], hints[f.name])
        if problem:
            raise ValueError(f"record {f.name} is {record[f.name]!r:.40}; expected {problem}")
    load = record.get("load_average")
    if load is not None and len(load) != 3:
        raise ValueError(f"record load_average is {load!r:.40}; expected three numbers (1, 5, 15 minutes) or null")
