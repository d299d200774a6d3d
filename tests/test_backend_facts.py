"""Backends own their facts: what the benchmark and the device check ask of a backend is answered by
its class (routes, flops, independent_queries + attend, implementation), and a built-in is its file,
its YAML values and its line in ``registry.BUILTINS``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attentions
from attentions import AttentionError, build_attention, build_config, get_attention, list_attentions
from attentions.ops.grouped import cpu as grouped_cpu
from lra.bench.estimate import slice_fn
from lra.bench.workloads import kernel_of, options_on
from lra.config import CONFIG_DIR

BUILT_INS = [n for n in list_attentions() if get_attention(n).__module__.startswith("attentions.")]


@pytest.mark.parametrize("name", [n for n in BUILT_INS if get_attention(n).independent_queries])
def test_a_slice_of_independent_queries_is_the_slice_of_the_whole(name: str) -> None:
    """What the benchmark scales up from (lra.bench.estimate) must be what the whole computes."""
    torch.manual_seed(0)
    attn = build_attention(name, num_heads=2, head_dim=16, max_len=96)
    q, k, v = (torch.randn(2, 2, 96, 16) for _ in range(3))
    whole = attn(q, k, v)
    assert slice_fn(attn) is not None
    torch.testing.assert_close(attn.attend(q[:, :, 40:57], k, v), whole[:, :, 40:57], rtol=1e-5, atol=1e-6)


def test_backends_without_independent_queries_give_no_slice() -> None:
    for name in BUILT_INS:
        attn = build_attention(name, num_heads=1, head_dim=8, max_len=64)
        if not attn.independent_queries:
            assert slice_fn(attn) is None
            with pytest.raises(NotImplementedError, match="independent_queries = False"):
                attn.attend(*(torch.randn(1, 1, 8, 8) for _ in range(3)))


def test_routing_is_read_from_the_taxonomy() -> None:
    routing = {n for n in BUILT_INS if get_attention(n).routes()}
    assert routing == {n for n in BUILT_INS if get_attention(n).taxonomy.scaling in ("routing", "both")}
    assert {"topk", "moba", "mita"} <= routing and "full" not in routing


def test_flop_counts_are_the_backends_own() -> None:
    n, d = 1024, 32
    assert get_attention("full").flops(build_config("full", {}), n, d) == (4.0 * n * n * d, 12.0 * n * n * d)
    forward, train = get_attention("mita").flops(build_config("mita", {"landmarks": 64, "topk": 64}), n, d)
    assert forward == 2 * 64 * n * d + 4 * 64 * n * d + 4 * n * 128 * d and train > 2 * forward
    # a backend that does not count its FLOPs says so
    assert get_attention("linear").flops(build_config("linear", {}), n, d) is None


def test_the_flash_baseline_is_an_option_of_full() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert options_on("full", {}, cuda) == {"flash": True} and options_on("full", {}, cpu) == {}
    assert options_on("mita", {"topk": 8}, cuda) == {"topk": 8}
    assert kernel_of("full", cpu) == "sdpa-cpu" and kernel_of("full", cuda) in ("flash-attn", "sdpa-flash")
    # on the CPU "auto" is the C kernel where it builds (a C compiler), else the PyTorch path
    cpu_kernel = "cpu" if grouped_cpu.takes(torch.zeros(0)) else "torch"
    assert kernel_of("mita", cpu) == f"attentions.mita ({cpu_kernel} kernel)" and kernel_of("linear", cpu) == "attentions.linear"
    flash = build_attention("full", num_heads=1, head_dim=8, max_len=16, flash=True)
    with pytest.raises(AttentionError, match="flash=True runs on CUDA only"):
        flash(*(torch.randn(1, 1, 16, 8) for _ in range(3)))


def test_every_built_in_has_its_lra_values() -> None:
    """The YAML values lra-run trains a built-in with ship with the package."""
    assert sorted(p.stem for p in (CONFIG_DIR / "attn").glob("*.yaml")) == sorted(BUILT_INS)


def test_a_new_built_in_is_one_file_and_one_line(tmp_path: Path) -> None:
    """Drop a backend file into (a copy of) attentions/backends/ and name it in registry.BUILTINS: it
    is listed, in its order, as a built-in; a module of the folder left out of the list is not imported."""
    package = tmp_path / "attentions"
    shutil.copytree(Path(attentions.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "backends" / "zebra.py").write_text(
        "from ..base import Attention, Taxonomy\nfrom ..registry import register\n\n\n"
        "@register(\"zebra\")\nclass Zebra(Attention):\n    paper = \"nobody 2026\"\n    order = 3.5\n"
        "    taxonomy = Taxonomy(\"none\", \"1\", \"raw KV\", \"none\", \"dense\")\n\n"
        "    def forward(self, q, k, v, mask=None):\n        return v\n"
    )
    (package / "backends" / "yak.py").write_text((package / "backends" / "zebra.py").read_text().replace("zebra", "yak"))
    registry = package / "registry.py"
    text = registry.read_text()
    assert "BUILTINS = (" in text
    registry.write_text(text.replace("BUILTINS = (", 'BUILTINS = ("zebra", ', 1))
    code = "from attentions import list_attentions, origin; print(' '.join(list_attentions()), origin('zebra'))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    names = out.stdout.split()
    assert names[-1] == "built-in"
    before = [n for n in BUILT_INS if get_attention(n).order < 3.5]
    after = [n for n in BUILT_INS if get_attention(n).order > 3.5]
    assert names[:-1] == before + ["zebra"] + after


@pytest.mark.parametrize("name", ["full", "linear", "linformer", "moba", "topk", "agent", "mita"])
def test_a_backends_root_module_path_imports_its_module_with_a_warning(name):
    import importlib
    import sys

    sys.modules.pop(f"attentions.{name}", None)
    with pytest.warns(DeprecationWarning, match=f"attentions.backends.{name}"):
        old = importlib.import_module(f"attentions.{name}")
    assert old is importlib.import_module(f"attentions.backends.{name}")


def test_every_builtin_names_its_published_rows_or_none():
    from attentions.backends import full, mita

    assert "Transformer" in full.FullAttention.published_as and mita.MiTAAttention.published_as == ("MiTA",)
    for name in BUILT_INS:
        assert isinstance(get_attention(name).published_as, tuple)
