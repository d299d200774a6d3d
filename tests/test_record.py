"""The record schema's versions: version 1 records (later fields optional) still read; version 2
requires every field; an unknown version is refused by name."""
from __future__ import annotations

import pytest

from lra.run.record import RECORD_KEYS, SCHEMA_VERSION, Record, validate_record

from table_records import make_record


def test_a_version_1_record_without_the_later_fields_reads() -> None:
    record = make_record("listops", "full", 0, 0.3)
    for key in ("load_average", "init_from", "matmul_gflops", "allocator", "boot_id"):
        record.pop(key, None)
    validate_record(record)


def test_a_version_2_record_must_hold_every_field() -> None:
    record = make_record("listops", "full", 0, 0.3)
    record.update(schema=2, load_average=[1.0, 1.0, 1.0], init_from=None, matmul_gflops=50.0,
                  allocator="default", boot_id="b")
    validate_record(record)
    del record["boot_id"]
    with pytest.raises(ValueError, match="record is missing boot_id"):
        validate_record(record)


def test_an_unknown_schema_version_is_refused() -> None:
    record = make_record("listops", "full", 0, 0.3)
    record["schema"] = 3
    with pytest.raises(ValueError, match="record schema is 3; this version reads 1, 2"):
        validate_record(record)


def test_the_record_written_is_the_current_version_with_every_field() -> None:
    values = {key: None for key in RECORD_KEYS if key != "schema"}
    values.update(status="completed", config={})
    data = Record(**values).to_dict()
    assert data["schema"] == SCHEMA_VERSION == 2
    assert list(data)[0] == "schema" and "boot_id" in data
