"""The taxonomy table: where every registered backend sits in the MiTA paper's five dimensions.

Generated from the code (each backend's ``paper``, ``taxonomy``, ``cost`` and budget), so a backend
added in one file, or loaded from a user's file, gets its row. The budget is the one lra-run trains
with: the backend built with the values of ``configs/attn/<name>.yaml`` where it has one (the same
settings as docs/backends.md's backend table), its class defaults otherwise.
"""
from __future__ import annotations


from typing import Any, Dict

from attentions import build_attention, get_attention, list_attentions, origin

from ..config import CONFIG_DIR, attn_options_for, backend_values
from ..format import Table

BUDGET_DIMS = {"num_heads": 1, "head_dim": 16, "max_len": 4096}


def lra_options(name: str) -> Dict[str, Any]:
    """The backend's values in configs/attn/<name>.yaml (before any task's section); {} without a file."""
    return attn_options_for(backend_values(name), "", CONFIG_DIR / "attn" / f"{name}.yaml")


def taxonomy_table() -> Table:
    dims = ", ".join(f"{k}={v}" for k, v in BUDGET_DIMS.items())
    table = Table("Where each backend sits in the MiTA taxonomy", [
        "Name", "Paper", "Scaling", "Expert count", "Expert type", "Construction", "Routing",
        f"Budget (N={BUDGET_DIMS['max_len']})", "Cost", "Mask", "From"])
    for name in list_attentions():
        cls = get_attention(name)
        # a user's backend that cannot be built at these sizes still gets its row
        try:
            budget = build_attention(name, **BUDGET_DIMS, **lra_options(name)).budget()
        except Exception as err:
            budget = f"(not built: {type(err).__name__}: {err})"
        tax = getattr(cls, "taxonomy", None)
        places = ([tax.scaling, tax.expert_count, tax.expert_type, tax.construction, tax.routing] if tax is not None
                  else ["(no taxonomy declared)"] + [""] * 4)
        table.rows.append([name, cls.paper, *places, budget, cls.cost, "yes" if cls.supports_mask else "no",
                           origin(name)])
    table.notes = [f"Generated from the code of every registered backend; budget = keys one query attends to "
                   f"({dims}) at the settings lra-run uses: configs/attn/<name>.yaml where the backend has one, "
                   "else its class defaults (these differ for linformer, k = 256, and topk, k = 64). "
                   "Mask: honours a padding mask."]
    return table
