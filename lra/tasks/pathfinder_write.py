"""Writing generated Pathfinder sets in the official layout, in parallel, resumable by batch.

``<folder>/imgs/<batch>/sample_<i>.png`` and ``<folder>/metadata/<batch>.npy`` (plain text lines, as
the original writes them), 1,000 images a batch; ``generator.json`` records the settings so that a
folder is never mixed with another set.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from multiprocessing import Pool
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from PIL import Image
from tqdm import tqdm

from ..errors import UserError
from .pathfinder_gen import Params, render_sample

BATCH = 1000
# images per unit of work handed to a worker process
CHUNK = 50
MANIFEST = "generator.json"

# one unit of work: (folder, params, seed, batch, first index, end index)
Job = Tuple[str, Params, int, int, int, int]


def image_seed(seed: int, p: Params, batch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, p.window, p.contour_length, batch, index])


def metadata_line(p: Params, batch: int, index: int, label: int, margin: int) -> str:
    """The original's metadata row: path parts, index, label, then the drawing parameters."""
    fields = [f"imgs/{batch}", f"sample_{index}.png", index, label, p.continuity, p.contour_length,
              p.distractor_length, p.paddle_length, p.paddle_thickness, margin, len(p.paddle_contrasts)]
    return " ".join(map(str, fields))


def render_chunk(job: Job) -> Tuple[int, List[str]]:
    """Draw and save images ``start..stop-1`` of one batch; returns (batch, metadata lines)."""
    folder, p, seed, batch, start, stop = job
    lines = []
    for index in range(start, stop):
        sample = render_sample(image_seed(seed, p, batch, index), p)
        Image.fromarray(sample.image).save(Path(folder) / "imgs" / str(batch) / f"sample_{index}.png")
        lines.append(metadata_line(p, batch, index, sample.label, sample.margin))
    return batch, lines


def batch_sizes(size: int) -> List[int]:
    return [min(BATCH, size - start) for start in range(0, size, BATCH)]


def check_manifest(folder: Path, manifest: Dict[str, object]) -> None:
    """Refuse to mix our images into a folder holding another set (the official release, another seed)."""
    # compare as stored: JSON turns tuples into lists
    manifest = json.loads(json.dumps(manifest))
    path = folder / MANIFEST
    has_data = any((folder / "metadata").glob("*.npy"))
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except ValueError:
            stored = None
        if stored == manifest:
            return
        raise UserError(
            f"{folder} holds Pathfinder images generated with other settings ({path}); "
            f"delete that folder or choose another data directory to generate {manifest['size']} images "
            f"with seed {manifest['seed']}"
        )
    if has_data:
        raise UserError(
            f"{folder} already holds Pathfinder data not made by this generator; leave it, or delete it to regenerate"
        )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))


def declared_size(folder: Path) -> Optional[int]:
    """The image count our generator.json promises for ``folder``; None for other sets (the release)."""
    try:
        size = json.loads((Path(folder) / MANIFEST).read_text()).get("size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) else None


def write_metadata(folder: Path, batch: int, lines: List[str]) -> None:
    """metadata/<batch>.npy as plain text lines (the format LRA's readers parse), written atomically."""
    meta = folder / "metadata"
    fd, tmp = tempfile.mkstemp(dir=meta, prefix=f".{batch}-")
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, meta / f"{batch}.npy")


def jobs(folder: Path, p: Params, seed: int, sizes: List[int], workers: int) -> Iterator[Job]:
    """Chunks of the unfinished batches; a batch whose metadata exists is done and skipped."""
    for batch, n in enumerate(sizes):
        if (folder / "metadata" / f"{batch}.npy").is_file():
            continue
        shutil.rmtree(folder / "imgs" / str(batch), ignore_errors=True)
        (folder / "imgs" / str(batch)).mkdir(parents=True)
        # small batches still give every worker a share
        chunk = min(CHUNK, -(-n // workers))
        for start in range(0, n, chunk):
            yield str(folder), p, seed, batch, start, min(start + chunk, n)


def generate(folder: Path, p: Params, size: int, seed: int, workers: int = 1) -> Path:
    """Write ``size`` images in the official layout under ``folder``; finished batches are kept on rerun.

    ``folder/imgs/<batch>/sample_<i>.png`` and ``folder/metadata/<batch>.npy``, 1,000 images a batch.
    """
    folder = Path(folder)
    check_manifest(folder, {"generator": "lra-suite snakes2 port v2", "size": size, "seed": seed, "params": asdict(p)})
    (folder / "metadata").mkdir(exist_ok=True)
    sizes = batch_sizes(size)
    todo = list(jobs(folder, p, seed, sizes, workers))
    pending = {b: [] for b in {job[3] for job in todo}}
    remaining = {b: sizes[b] for b in pending}
    bar = tqdm(total=sum(job[5] - job[4] for job in todo), desc=f"pathfinder{p.window}", unit="img")
    pool = Pool(workers) if workers > 1 and len(todo) > 1 else None
    try:
        results = pool.imap(render_chunk, todo) if pool else map(render_chunk, todo)
        for batch, lines in results:
            pending[batch] += lines
            remaining[batch] -= len(lines)
            bar.update(len(lines))
            if remaining[batch] == 0:
                write_metadata(folder, batch, pending.pop(batch))
    finally:
        bar.close()
        if pool:
            # every result is in on success; on an error or Ctrl-C this stops the workers at once
            pool.terminate()
            pool.join()
    return folder
