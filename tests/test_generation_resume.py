"""Generated data survives a kill: ListOps, Pathfinder-32 and Path-X generations killed part-way (a real
SIGKILL to a child process, or Ctrl-C) continue where they stopped, and end with the same bytes as a
generation never stopped. Units are made small (module constants set in the child and here) so that
a kill lands between finished ones within a second or two."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict

import pytest

from conftest import ROOT
from lra.tasks import listops_gen, pathfinder_draw, pathfinder_write

# ListOps: 10 trees a chunk, so its 264-row set (size 200 and two held-out splits of 32) is 27 chunks
LISTOPS_CHUNK, LISTOPS_SIZE = 10, 200
# Pathfinder / Path-X: images per batch and per chunk, and the set's size
PATHFINDER = {"pathfinder32": (32, 4, 2, 24), "pathx": (128, 2, 1, 4)}


def hashes(folder: Path) -> Dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def child(code: str) -> subprocess.Popen:
    """``code`` in a new Python process that imports this checkout's lra."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` once ``ready()``; the child must still be running then (the kill lands part-way)."""
    deadline = time.time() + 300
    while not ready():
        assert proc.poll() is None, f"the generation ended before the kill: {proc.communicate()}"
        assert time.time() < deadline, "the generation did not get far enough in 5 minutes"
        time.sleep(0.005)
    proc.send_signal(sig)
    proc.wait(timeout=60)


# each chunk of a child's ListOps generation made 50 ms slower, so that the signal sent once a few
# shards are on disk lands while the rest are being made, however busy the machine (a chunk of 10
# rows alone takes about a millisecond)
SLOW_LISTOPS_CHUNKS = """
    import time
    from lra.tasks import listops_gen
    chunk_of = listops_gen.generate_chunk
    def slow_chunk(args):
        time.sleep(0.05)
        return chunk_of(args)
    listops_gen.generate_chunk = slow_chunk
"""
LISTOPS_CHILD = SLOW_LISTOPS_CHUNKS + """
    from pathlib import Path
    from lra.tasks import listops_gen
    listops_gen.CHUNK = {chunk}
    listops_gen.generate_files(Path({folder!r}), size={size}, seed=0, workers=1)
"""


def test_a_killed_listops_generation_continues_to_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "killed"
    proc = child(LISTOPS_CHILD.format(chunk=LISTOPS_CHUNK, folder=str(folder), size=LISTOPS_SIZE))
    parts = folder / listops_gen.PARTS
    kill_when(proc, lambda: len(list(parts.glob("*.tsv.gz"))) >= 5)
    assert proc.returncode == -signal.SIGKILL
    assert not (folder / "basic_train.tsv").exists()
    kept = len(list(parts.glob("*.tsv.gz")))
    # the rerun draws only the chunks the killed one had not finished
    monkeypatch.setattr(listops_gen, "CHUNK", LISTOPS_CHUNK)
    drawn = []
    generate_chunk = listops_gen.generate_chunk
    monkeypatch.setattr(listops_gen, "generate_chunk", lambda args: drawn.append(args[1]) or generate_chunk(args))
    listops_gen.generate_files(folder, size=LISTOPS_SIZE, seed=0, workers=1)
    assert drawn and min(drawn) >= kept
    assert not parts.exists()
    listops_gen.generate_files(tmp_path / "whole", size=LISTOPS_SIZE, seed=0, workers=1)
    assert hashes(folder) == hashes(tmp_path / "whole")


def test_ctrl_c_in_lra_data_keeps_the_listops_shards_and_says_so(tmp_path: Path) -> None:
    code = textwrap.dedent(SLOW_LISTOPS_CHUNKS) + textwrap.dedent(f"""
        import signal
        import sys
        # Ctrl-C as a terminal delivers it: a suite started as a shell's background job hands its
        # children SIGINT ignored, and Python then keeps it ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from lra.tasks import listops, listops_gen
        listops_gen.CHUNK = {LISTOPS_CHUNK}
        listops.NOTICE_MB = 0
        from lra.cli.data import entry
        sys.argv = ["lra-data", "generate", "listops", "--size", "{LISTOPS_SIZE}", "--data-dir", {str(tmp_path)!r}]
        entry()
    """)
    proc = child(code)
    parts = tmp_path / f"listops_n{LISTOPS_SIZE}_seed0" / listops_gen.PARTS
    kill_when(proc, lambda: len(list(parts.glob("*.tsv.gz"))) >= 3, signal.SIGINT)
    err = proc.stderr.read()
    assert proc.returncode == 130, err
    assert "lra: ListOps generation stopped; its finished shards are kept in" in err
    assert "lra-data: interrupted" in err.splitlines()[-1]
    assert len(list(parts.glob("*.tsv.gz"))) >= 3


PATHFINDER_CHILD = """
    from pathlib import Path
    from lra.tasks import pathfinder_draw, pathfinder_write
    pathfinder_write.BATCH, pathfinder_write.CHUNK = {batch}, {chunk}
    p = pathfinder_draw.lra_params({side}, "curv_baseline")
    pathfinder_write.generate(Path({folder!r}), p, size={size}, seed=0, workers=1)
"""


@pytest.mark.parametrize("name", list(PATHFINDER))
def test_a_killed_pathfinder_generation_continues_to_the_same_bytes(name: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    side, batch, chunk, size = PATHFINDER[name]
    folder = tmp_path / "killed"
    proc = child(PATHFINDER_CHILD.format(batch=batch, chunk=chunk, side=side, folder=str(folder), size=size))
    # killed once a batch is finished and a chunk of the next one too (Path-X: once its first chunk is)
    if name == "pathx":
        kill_when(proc, lambda: any((folder / "imgs").glob("*/chunk_*.txt")))
    else:
        kill_when(proc, lambda: (folder / "metadata" / "0.npy").is_file() and any((folder / "imgs" / "1").glob("chunk_*")))
    assert proc.returncode == -signal.SIGKILL
    listed = len(list((folder / "metadata").glob("*.npy")))
    assert listed < -(-size // batch)
    monkeypatch.setattr(pathfinder_write, "BATCH", batch)
    monkeypatch.setattr(pathfinder_write, "CHUNK", chunk)
    drawn = []
    render_chunk = pathfinder_write.render_chunk
    monkeypatch.setattr(pathfinder_write, "render_chunk", lambda job: drawn.append(job[5] - job[4]) or render_chunk(job))
    p = pathfinder_draw.lra_params(side, "curv_baseline")
    pathfinder_write.generate(folder, p, size=size, seed=0, workers=1)
    # the finished batches and chunks were kept, not drawn again
    assert 0 < sum(drawn) < size
    assert not list(folder.glob("imgs/*/chunk_*"))
    pathfinder_write.generate(tmp_path / "whole", p, size=size, seed=0, workers=1)
    assert hashes(folder) == hashes(tmp_path / "whole")


def test_a_long_pathfinder_generation_says_what_the_rest_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capfd: pytest.CaptureFixture) -> None:
    # every generation counts as long here
    monkeypatch.setattr(pathfinder_write, "NOTICE_S", 0)
    monkeypatch.setattr(pathfinder_write, "CHUNK", 2)
    pathfinder_write.generate(tmp_path, pathfinder_draw.lra_params(32, "curv_baseline"), size=6, seed=0, workers=1)
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("lra: pathfinder32 generation: about ") and line.endswith(
        " left here (at the pace of its first 2 images); if stopped, the next run picks up where it left off")
