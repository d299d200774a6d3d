"""What the plots of lra-table share: the PNG writer, the backends' families, and how a backend is drawn.

With 22 backends and more, one panel of many lines or bars cannot be read: the plots are small multiples,
one panel per family (the taxonomy's scaling strategy: routing, compression, both, neither), each of
at most ten backends in colours and markers of their own. MiTA, the backend the suite checks, is drawn
apart in every plot (red, a star, its name in bold), and in every family's panel as the reference to
compare with, beside full attention (black, dashed).
"""
from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..files import write_atomic  # noqa: E402
from ..format import mechanism  # noqa: E402

# the taxonomy's scaling strategies (attentions.base.Taxonomy.scaling) in the order the families are drawn
FAMILIES = (("routing", "routing"), ("compression", "compression"), ("both", "both"), ("none", "neither"))
# the backend drawn apart, and the reference beside it
FOCUS, REFERENCE = "mita", "full"
FOCUS_STYLE = {"color": "#d62728", "marker": "*", "markersize": 11, "linewidth": 2.6, "zorder": 5}
REFERENCE_STYLE = {"color": "black", "marker": "s", "markersize": 5, "linewidth": 1.4, "linestyle": "--", "zorder": 4}
# the other backends of a panel: tab10 without its red (MiTA's), each with a marker of its own
# eleven colours (tab10 without its red, the focus's, and two of tab20b) and ten markers: the
# families' panels hold up to eleven backends besides the focus and the reference, each distinct
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
           "#637939", "#7b4173"]
MARKERS = ["o", "s", "D", "^", "v", "P", "X", "<", ">", "h"]
# a family's colour where a plot colours by family (the focus keeps its own)
FAMILY_COLOURS = {"routing": "#1f77b4", "compression": "#2ca02c", "both": "#9467bd", "none": "#7f7f7f"}


def save(fig: Any, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=150, bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return path


def family_of(attn: str) -> str:
    """The backend's scaling strategy ("unregistered" for a name the registry lacks); a row of another
    form of a backend ("reformer (chunked)", ``format.model``) is in its backend's family."""
    from attentions import scaling_of

    return scaling_of(mechanism(attn))


def family_title(family: str) -> str:
    return dict(FAMILIES).get(family, family)


def by_family(rows: List[Any], name: Callable[[Any], str] = lambda row: row.attn) -> List[Tuple[str, List[Any]]]:
    """The rows grouped by their backend's family (``attentions.scaling_of``), families in ``FAMILIES``
    order (then any other), rows in their given order within a family; a family with no row is left out."""
    groups: Dict[str, List[Any]] = defaultdict(list)
    for row in rows:
        groups[family_of(name(row))].append(row)
    order = [f for f, _ in FAMILIES] + sorted(set(groups) - {f for f, _ in FAMILIES})
    return [(f, groups[f]) for f in order if groups.get(f)]


def line_styles(names: List[str]) -> Dict[str, Dict[str, Any]]:
    """Matplotlib keyword arguments per backend name of one panel: the focus's and the reference's own,
    every other a colour and a marker of its own (cycling past eleven)."""
    styles: Dict[str, Dict[str, Any]] = {}
    others = 0
    for name in names:
        attn = name.split(" ")[0]
        if attn == FOCUS:
            styles[name] = dict(FOCUS_STYLE)
        elif attn == REFERENCE:
            styles[name] = dict(REFERENCE_STYLE)
        else:
            styles[name] = {"color": COLOURS[others % len(COLOURS)], "marker": MARKERS[others % len(MARKERS)],
                            "markersize": 5, "linewidth": 1.4, "zorder": 3}
            others += 1
    return styles


def bold_focus(labels: Any) -> None:
    """The focus's tick labels in bold and its colour."""
    for label in labels:
        if label.get_text().split(" ")[0] == FOCUS:
            label.set_fontweight("bold")
            label.set_color(FOCUS_STYLE["color"])


def tuned_keys(records: Iterable[Dict[str, Any]]) -> List[str]:
    """The config keys tuned (lra-sweep tune: each record's ``config.tuning.grid``) in any of ``records``."""
    return sorted({key for r in records for key in (((r.get("config") or {}).get("tuning") or {}).get("grid") or {})})


def finish(fig: Any, title: str, handles: Dict[str, Any], path: Path,
           before_save: Optional[Callable[[], Any]] = None) -> Path:
    """The figure's title and (when given) its legend outside the axes, saved to ``path``;
    ``before_save`` runs once the layout is final (what is placed in display units goes on there)."""
    fig.suptitle(title, fontsize=10)
    if handles:
        fig.legend(list(handles.values()), list(handles), fontsize="small", loc="upper left",
                   bbox_to_anchor=(1.0, 0.9), frameon=False)
    fig.tight_layout()
    if before_save is not None:
        before_save()
    return save(fig, path)
