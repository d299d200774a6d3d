"""Resuming a sweep: an unfinished record in --out, of the same settings on the same machine, keeps
the points it holds and the sweep measures only the rest.

A sweep saves its record after every point with ``complete: false`` (lra/bench/cli.py), so a sweep
stopped part-way (Ctrl-C, a kill, a pre-empted job, a session that ended) leaves what it measured.
Run with the same command and --out again, it keeps those points: a point of the separate sweep
(one backend at one length), a whole length of an interleaved one (every backend at that length was
timed in the same rounds; a length cut short is measured again, whole). Kept points are the
measurements they were; ``record["resumed"]`` says when each resumption ran, at which commit, and
how many points it kept, and the table says so.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import UserError

# what must match for points of two runs to sit in one record: the machine and the torch build
SAME_HARDWARE = ("device", "cpu_model", "cpu_cores_usable", "gpu")
SAME_VERSIONS = ("torch", "cuda", "flash_attn")
# settings that may differ: the CPU's default memory cap follows the memory available at the start
# (each resumption's cap is in its entry of record["resumed"])
MAY_DIFFER = ("max_mem_gb",)

Points = Dict[Tuple[str, int], Dict[str, Any]]


def unfinished(path: Path) -> Optional[Dict[str, Any]]:
    """The record at ``path`` when a sweep left it unfinished; None when there is none or it is complete."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not an lra-bench record ({type(err).__name__}); delete it or give another --out")
    fields = (("settings", dict), ("points", list), ("hardware", dict))
    if not isinstance(record, dict) or not all(isinstance(record.get(key), kind) for key, kind in fields):
        raise UserError(f"{path}: not an lra-bench record (no settings, points and hardware); "
                        "delete it or give another --out")
    return None if record.get("complete", True) else record


def plain(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples as lists, ...), so settings compare as recorded."""
    return json.loads(json.dumps(value))


def check_same(partial: Dict[str, Any], settings: Dict[str, Any], hardware: Dict[str, Any],
               versions: Dict[str, Any], path: Path) -> None:
    """A UserError naming what differs when ``partial`` was not measured with these settings on this machine."""
    differ: List[str] = []
    old, new = partial["settings"], plain(settings)
    differ += [f"--{key.replace('_', '-')}" for key in sorted(set(old) | set(new))
               if key not in MAY_DIFFER and old.get(key) != new.get(key)]
    differ += [key for key in SAME_HARDWARE if partial["hardware"].get(key) != hardware.get(key)]
    differ += [key for key in SAME_VERSIONS if (partial.get("versions") or {}).get(key) != versions.get(key)]
    if differ:
        raise UserError(f"--out {path.parent} holds an unfinished sweep that differs from this one in "
                        f"{', '.join(differ)}; run its own command to finish it, give another --out, "
                        f"or delete {path} to start again")


def kept_points(partial: Dict[str, Any], interleaved: bool) -> Tuple[Points, Dict[int, Dict[str, Any]]]:
    """The points to keep, by (backend, length), and an interleaved sweep's per-length entries of the
    lengths kept: only lengths whose every backend has its point."""
    points: Points = {(p["backend"], p["length"]): p for p in partial["points"]}
    if not interleaved:
        return points, {}
    backends = partial["settings"]["backends"]
    whole = {entry["length"]: entry for entry in partial.get("per_length") or []
             if all((b, entry["length"]) in points for b in backends)}
    return {key: p for key, p in points.items() if key[1] in whole}, whole
