"""The result record: one JSON file per run, the source of every table.

Schema (version 1). Keys are stable; later versions only add keys.

    schema          1
    status          "completed" | "diverged" | "running" (a checkpointed run not yet finished)
    run_name        folder name of the run under ``out``
    task, attn, preset, seed
    config          the resolved RunConfig (model / train / data / attn_options)
    attn_budget     keys one query attends to, from the backend (e.g. "m + k = 128")
    steps           optimizer steps taken
    best_step       step of the best validation accuracy (the checkpoint tested)
    val_acc         best validation accuracy (fraction, 0-1)
    test_acc        test accuracy of the best-validation checkpoint (fraction)
    majority_acc    accuracy of always predicting the test split's most common label (fraction)
    test_examples   test examples evaluated (the whole split unless train.test_batches limits it)
    final_train_loss  mean training loss over the last logging window
    train_time_s    wall-clock seconds of training steps (evaluation excluded), summed over resumes
    eval_time_s     wall-clock seconds spent evaluating
    tokens_per_s    training tokens (padded length x batch) per second of train_time_s
    peak_memory_mb  peak memory: CUDA max_memory_allocated, or the process's peak RSS on the CPU
    memory_kind     "cuda_max_allocated" | "cpu_peak_rss"
    params          trainable parameters
    device, device_name, world_size, precision
    torch, python, git_commit, hostname
    started_at, finished_at  ISO-8601 UTC
    message         why the run stopped, when it did not complete
    load_average    the machine's 1, 5 and 15 minute load averages when training ended (the run's own
                    threads included); optional: records written before it was added lack it
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict



SCHEMA_VERSION = 1
RECORD_KEYS = (
    "schema", "status", "run_name", "task", "attn", "preset", "seed", "config", "attn_budget", "steps",
    "best_step", "val_acc", "test_acc", "majority_acc", "test_examples", "final_train_loss", "train_time_s", "eval_time_s",
    "tokens_per_s", "peak_memory_mb", "memory_kind", "params", "device", "device_name", "world_size",
    "precision", "torch", "python", "git_commit", "hostname", "started_at", "finished_at", "message",
)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")





STATUSES = ("completed", "diverged", "running")
TEXT_KEYS = ("run_name", "task", "attn", "preset", "memory_kind", "device_name")
# numbers that may be null (no validation, no test, a diverged run's loss)
NUMBER_KEYS = ("val_acc", "test_acc", "majority_acc", "final_train_loss", "train_time_s", "eval_time_s",
               "tokens_per_s", "peak_memory_mb")


def validate_record(record: Dict[str, Any]) -> None:
    """Raise ValueError naming the first missing key or ill-typed value (used by tests and by lra-table)."""
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"record is missing {', '.join(missing)}")
    if record["status"] not in STATUSES:
        raise ValueError(f"record status is {record['status']!r}; expected one of {', '.join(STATUSES)}")
    for key in TEXT_KEYS:
        if not isinstance(record[key], str):
            raise ValueError(f"record {key} is {record[key]!r}; expected a string")
    for key in ("seed", "steps", "best_step"):
        if not isinstance(record[key], int) or isinstance(record[key], bool):
            raise ValueError(f"record {key} is {record[key]!r}; expected a whole number")
    for key in NUMBER_KEYS:
        value = record[key]
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"record {key} is {value!r:.40}; expected a number or null")
    load = record.get("load_average")
    if load is not None and (not isinstance(load, list) or len(load) != 3
                             or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in load)):
        raise ValueError(f"record load_average is {load!r:.40}; expected three numbers (1, 5, 15 minutes) or null")
    if not isinstance(record["finished_at"], (str, type(None))):
        raise ValueError(f"record finished_at is {record['finished_at']!r}; expected a time stamp")
