"""The analyses' figures (matplotlib, Agg, PNG, written atomically): the budget heat map, and for
image tasks the per-layer map of selected pixels and single examples with their selected pixels."""
from __future__ import annotations

from pathlib import Path
from typing import List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from ..tables.plots import save  # noqa: E402
from .budget import Cell, Grid  # noqa: E402
from .tokens import Selections, pixel_frequency  # noqa: E402


def budget_heatmap(cells: List[Cell], grid: Grid, title: str, path: Path) -> Path:
    """Test accuracy over one or two options (the first down, the second across), each cell with its
    accuracy and cost per query, the trained setting boxed."""
    keys = list(grid)
    down = grid[keys[0]] if len(keys) == 2 else [None]
    across = grid[keys[-1]]
    by = {tuple(c.options[k] for k in keys): c for c in cells}

    def at(i: int, j: int) -> Cell:
        return by[(down[i], across[j]) if len(keys) == 2 else (across[j],)]

    acc = np.array([[100 * at(i, j).acc for j in range(len(across))] for i in range(len(down))])  # [rows, cols]
    fig, ax = plt.subplots(figsize=(1.5 + 1.45 * len(across), 1.4 + 0.9 * len(down)))
    image = ax.imshow(acc, cmap="viridis", aspect="auto")
    middle = (acc.max() + acc.min()) / 2
    for i in range(len(down)):
        for j in range(len(across)):
            cell = at(i, j)
            # the budget's formula above its value: "topk x block_size" / "= 128"
            ax.text(j, i, f"{100 * cell.acc:.1f}%\n{cell.budget.replace(' = ', chr(10) + '= ')}", ha="center", va="center", fontsize=7,
                    color="black" if acc[i, j] > middle else "white")
            if cell.trained:
                ax.add_patch(Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False, edgecolor="red", linewidth=2.5))
    ax.set_xticks(range(len(across)), [str(v) for v in across])
    ax.set_xlabel(f"attn.{keys[-1]}")
    if len(keys) == 2:
        ax.set_yticks(range(len(down)), [str(v) for v in down])
        ax.set_ylabel(f"attn.{keys[0]}")
    else:
        ax.set_yticks([])
    fig.colorbar(image, ax=ax, label="test accuracy (%)")
    ax.set_title(title + "\n(red box: the trained setting; each cell: accuracy and cost per query)", fontsize=9)
    return save(fig, path)


def pixel_maps(frequency: List[np.ndarray], mean_image: np.ndarray, title: str, path: Path) -> Path:
    """The mean test image, then per layer how often each pixel is selected (fraction of image-head pairs)."""
    panels = len(frequency) + 1
    fig, axes = plt.subplots(1, panels, figsize=(2.8 * panels, 3.0))
    axes[0].imshow(mean_image, cmap="gray")
    axes[0].set_title("mean test image", fontsize=9)
    for i, freq in enumerate(frequency):
        shown = axes[i + 1].imshow(freq, cmap="magma", vmin=0, vmax=max(float(freq.max()), 1e-9))
        axes[i + 1].set_title(f"layer {i + 1}: selected", fontsize=9)
        bar = fig.colorbar(shown, ax=axes[i + 1], fraction=0.046, pad=0.04)
        bar.set_label("fraction of (image, head) pairs", fontsize=7)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def example_overlays(images: np.ndarray, selected: List[np.ndarray], labels: List[int], title: str, path: Path) -> Path:
    """One row per example: the image, then per layer the image with its selected pixels in red
    (stronger where more experts of more heads select them). images [K, S, S]; selected[layer] [K, S, S]."""
    rows, cols = len(images), len(selected) + 1
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.4 * rows), squeeze=False)
    for r in range(rows):
        axes[r, 0].imshow(images[r], cmap="gray", vmin=0, vmax=255)
        axes[r, 0].set_title(f"example {r + 1}, label {labels[r]}", fontsize=8)
        for layer, counts in enumerate(selected):
            overlay = np.zeros((*counts[r].shape, 4))
            overlay[..., 0] = 1.0
            overlay[..., 3] = np.where(counts[r] > 0, 0.35 + 0.65 * counts[r] / max(int(counts[r].max()), 1), 0.0)
            axes[r, layer + 1].imshow(images[r], cmap="gray", vmin=0, vmax=255)
            axes[r, layer + 1].imshow(overlay)
            share = float((counts[r] > 0).mean())
            axes[r, layer + 1].set_title(f"layer {layer + 1}: {100 * share:.0f}% of pixels selected", fontsize=8)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def image_figures(sel: Selections, labels: np.ndarray, side: int, show: int, name: str, out: Path) -> List[Path]:
    """The image-task figures under ``out``: the per-layer pixel maps, and ``show`` single examples."""
    tokens = np.asarray(sel.tokens, dtype=np.float64)
    frequency = [pixel_frequency(c, side) for c in sel.counts]
    written = [pixel_maps(frequency, tokens.mean(0).reshape(side, side), f"{name}: pixels selected into routed experts",
                          out / "tokens_pixels.png")]
    shown = min(show, len(tokens))
    if shown:
        # per layer, each pixel's selections summed over the heads
        selected = [c[:shown].sum(1).numpy().reshape(-1, side, side) for c in sel.counts]
        written.append(example_overlays(tokens[:shown].reshape(-1, side, side), selected,
                                        [int(v) for v in labels[:shown]], f"{name}: selected pixels of single test images",
                                        out / "tokens_examples.png"))
    return written
