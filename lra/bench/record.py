"""Reading an lra-bench sweep record back: ``lra-bench report`` and lra-table's throughput tables both
read it here, and a file that is not one is a one-line error naming it. lra/bench/sweep.py writes it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Union

from ..errors import UserError

# what the readers need of a sweep record (lra/bench/sweep.py writes them all, a stopped sweep too)
RECORD_KEYS = ("kind", "level", "hardware", "versions", "settings", "load_average", "points")


def read_record(path: Union[str, Path]) -> Dict[str, Any]:
    """A sweep record written by lra-bench; anything else is a UserError of one line naming the file."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read a lra-bench record ({err})")
    if not isinstance(record, dict):
        raise UserError(f"{path} holds a JSON {type(record).__name__}, not a lra-bench record (a JSON object)")
    if record.get("kind") != "lra-bench":
        raise UserError(f"{path} is not a lra-bench record (no \"kind\": \"lra-bench\")")
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        raise UserError(f"{path}: the lra-bench record lacks {', '.join(missing)}; rerun the sweep that wrote it")
    if not isinstance(record["points"], list):
        raise UserError(f"{path}: the lra-bench record's points are not a list; rerun the sweep that wrote it")
    return record
