"""The modules that define custom operators keep their annotations as objects, not strings: torch
2.4-2.6, inside the range the project asks for (pyproject.toml: torch>=2.4), read an operator's schema
from its function's annotations and refuse them as strings (``from __future__ import annotations``):
importing the package failed there ("infer_schema(func): Parameter q has unsupported type
torch.Tensor" on 2.4, "Unsupported type annotation Tuple[...]" on 2.5 and 2.6). The torch installed
here reads both, so this is checked on the source."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("attentions", "lra")


def defines_custom_op(tree: ast.AST) -> bool:
    """Whether the module calls torch.library's custom_op (as ``custom_op(...)`` or ``x.custom_op(...)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "custom_op":
                return True
    return False


def postpones_annotations(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
               and any(alias.name == "annotations" for alias in node.names) for node in tree.body)


def operator_modules() -> dict:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            if defines_custom_op(tree):
                modules[path.relative_to(ROOT).as_posix()] = tree
    return modules


def test_the_operator_modules_are_found() -> None:
    found = set(operator_modules())
    assert {"attentions/ops/grouped/cpu.py", "attentions/ops/landmark/mita_layer_cpu.py",
            "lra/model/dropout.py", "lra/model/layer_norm.py", "lra/model/gelu_dropout.py"} <= found


def test_no_operator_module_postpones_its_annotations() -> None:
    postponed = [name for name, tree in operator_modules().items() if postpones_annotations(tree)]
    assert postponed == [], (f"{postponed} use `from __future__ import annotations`: torch 2.4-2.6 cannot read "
                             f"a custom operator's schema from string annotations")


def test_the_check_sees_a_postponed_module() -> None:
    tree = ast.parse("from __future__ import annotations\nfrom torch.library import custom_op\n"
                     "@custom_op('x::y', mutates_args=())\ndef y(a: 'torch.Tensor') -> 'torch.Tensor': ...\n")
    assert defines_custom_op(tree) and postpones_annotations(tree)
