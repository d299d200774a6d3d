"""lra-bench: sweeps write valid records, failures are recorded, slopes and estimates are right."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch

from conftest import load_script
from lra.bench.cli import main, parse_length
from lra.bench.estimate import scale_stats
from lra.bench.flops import attention_flops
from lra.bench.point import run_point
from lra.bench.report import loglog_slope, slopes
from lra.bench.sweep import Settings, sweep
from lra.cli import guarded
from lra.errors import UserError

TINY = ["--budget-s", "60", "--threads", "1", "--warmup", "1", "--repeats", "2", "--quiet", "--no-plot"]


def bench(tmp_path: Path, *args: str) -> Dict[str, Any]:
    assert main([args[0], *TINY, *args[1:], "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "record.json").read_text())


def statuses(record: Dict[str, Any]) -> List[tuple]:
    return [(p["backend"], p["length"], p["status"]) for p in record["points"]]


@pytest.mark.parametrize("text,tokens", [("256", 256), ("4k", 4096), ("64K", 65536), ("1m", 2**20)], ids=str)
def test_lengths_use_binary_suffixes(text: str, tokens: int) -> None:
    assert parse_length(text) == tokens


@pytest.mark.parametrize("text", ["12q", "0", "k", "-4k", "1.5k"], ids=str)
def test_bad_lengths_say_what_is_valid(text: str) -> None:
    with pytest.raises(UserError, match="suffix"):
        parse_length(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["attention", "--lengths", "12q"],
        ["attention", "--lengths", "0"],
        ["attention", "--attn", "full,nosuch"],
        ["attention", "--attn", "mita", "--attn-opt", "mita.nosuch=3"],
        ["attention", "--attn", "full", "--attn-opt", "mita.topk=3"],
        ["attention", "--budget-s", "0"],
        ["model", "--width", "130", "--heads", "4"],
    ],
    ids=["bad-length", "zero-length", "unknown-backend", "unknown-option", "option-of-absent-backend", "zero-budget", "width-heads"],
)
def test_bad_input_is_one_line_exit_2(argv: List[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert guarded("lra-bench", lambda: main([*argv, "--out", str(tmp_path / "out")])) == 2
    err = capsys.readouterr().err
    assert err.startswith("lra-bench: error: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_attention_sweep_writes_a_valid_record(tmp_path: Path) -> None:
    record = bench(tmp_path, "attention", "--attn", "full,linear", "--lengths", "256,512", "--gemm-size", "256")
    assert record["complete"] and record["level"] == "attention"
    assert statuses(record) == [("full", 256, "ok"), ("linear", 256, "ok"), ("full", 512, "ok"), ("linear", 512, "ok")]
    for point in record["points"]:
        for mode in ("forward", "train"):
            stats = point[mode]
            assert stats["repeats"] == 2 and stats["min_s"] <= stats["median_s"] <= stats["max_s"]
            assert point["tokens_per_s"][mode] == pytest.approx(point["length"] / stats["median_s"])
        assert point["peak_mem_mb"] >= 0 and point["baseline_mem_mb"] > 0 and not point["estimated"]
    assert record["hardware"]["cpu_model"] and record["hardware"]["cpu_cores"] >= 1
    assert record["versions"]["torch"] and len(record["load_average"]["start"]) == 3 and record["load_average"]["end"]
    assert record["gemm"]["status"] == "ok" and record["gemm"]["flops_per_s"] > 0
    assert set(record["slopes"]) == {"full", "linear"}
    assert [row["backend"] for row in record["efficiency"]["points"]] == ["full", "full"]
    table = (tmp_path / "table.md").read_text()
    assert "| full |" in table and "| linear |" in table and "Slope" in table
    # lra-bench report writes the same table again from the record alone
    (tmp_path / "table.md").unlink()
    assert main(["report", str(tmp_path / "record.json"), "--no-plot"]) == 0
    assert (tmp_path / "table.md").read_text() == table
    assert "Incomplete sweep" not in table
    # a sweep stopped part-way (its partial record) says so above its tables
    partial = json.loads((tmp_path / "record.json").read_text())
    partial["complete"] = False
    (tmp_path / "record.json").write_text(json.dumps(partial))
    assert main(["report", str(tmp_path / "record.json"), "--no-plot"]) == 0
    assert "**Incomplete sweep**: it was stopped before every point ran" in (tmp_path / "table.md").read_text()


def test_out_of_budget_and_out_of_memory_points_are_recorded(tmp_path: Path) -> None:
    slow = bench(tmp_path / "slow", "attention", "--attn", "full,linear", "--lengths", "2k", "--budget-s", "0.001",
                 "--estimate", "never", "--gemm-size", "0")
    assert statuses(slow) == [("full", 2048, "timeout"), ("linear", 2048, "timeout")]
    # 3 x [1, 4, 256K, 32] float32 inputs are 384 MiB, past a 50 MiB cap; the longer length is not run
    big = bench(tmp_path / "big", "attention", "--attn", "full", "--lengths", "256k,512k", "--max-mem-gb", "0.05",
                "--gemm-size", "0")
    assert statuses(big) == [("full", 2**18, "oom"), ("full", 2**19, "oom")]
    assert [p["skipped"] for p in big["points"]] == [False, True]
    assert "can't allocate memory" in big["points"][0]["message"]
    assert "| full | oom | (oom) |" in (tmp_path / "big" / "table.md").read_text()


def test_a_child_past_its_budget_is_killed() -> None:
    settings = Settings(
        level="attention", backends=["full"], lengths=[2**15], device="cpu", dtype="float32", batch=1,
        heads=4, head_dim=32, layers=3, width=128, ffn_dim=256, dropout=0.0, budget_s=0.01, max_mem_gb=None,
        warmup=1, repeats=1, estimate="never", slice_queries=1024, threads=1, gemm_size=0, max_batch=1,
        min_gain=0.0, slack_s=0.5,
    )
    record = sweep(settings, quiet=True)
    assert statuses(record) == [("full", 2**15, "timeout")]
    assert record["points"][0]["message"].startswith("killed after")


def test_model_sweep_searches_the_batch(tmp_path: Path) -> None:
    record = bench(tmp_path, "model", "--attn", "linear", "--lengths", "128", "--layers", "1", "--width", "32",
                   "--heads", "2", "--ffn-dim", "32", "--max-batch", "4", "--min-gain", "-1", "--gemm-size", "0")
    point = record["points"][0]
    trials = point["batch_search"]
    assert [t["batch"] for t in trials] == [1, 2, 4] and all(t["status"] == "ok" for t in trials)
    best = max(trials, key=lambda t: t["tokens_per_s"]["train"])
    assert point["batch"] == best["batch"] and point["status"] == "ok"


def test_a_record_of_many_backends_is_drawn_one_family_per_column() -> None:
    """The committed every-backend record: one column per taxonomy family, each time panel with the slope
    guides, full attention and exactly that family's backends; a record of few backends keeps two panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attentions import scaling_of
    from lra.bench.plot import FAMILY_TITLES, family_panels, plot, timed, two_panels

    root = Path(__file__).resolve().parent.parent
    record = json.loads((root / "results/throughput/attention-all-intel-xeon-2c/record.json").read_text())
    backends = [b for b in record["settings"]["backends"] if timed(record, b)]
    assert plot(record)[:8] == b"\x89PNG\r\n\x1a\n"
    fig = family_panels(plt, record, backends)
    top = fig.axes[: len(fig.axes) // 2]
    assert [ax.get_title() for ax in top] == [FAMILY_TITLES[f] for f in ("routing", "compression", "both", "none")]
    for ax, family in zip(top, ("routing", "compression", "both", "none")):
        names = [t.get_text() for t in ax.get_legend().get_texts()]
        assert names[:3] == ["slope 1 (cost ~ N)", "slope 2 (cost ~ N^2)", "full"] or family == "none"
        assert {n for n in names if not n.startswith("slope") and n != "full"} == {
            b for b in backends if scaling_of(b) == family and b != "full"}
    plt.close(fig)
    few = two_panels(plt, record, ["full", "mita"])
    assert len(few.axes) == 2
    plt.close(few)


def test_an_interleaved_record_of_several_batches_plots_time_per_sequence_with_each_batch_named() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lra.bench.plot import batches, family_panels, timed

    root = Path(__file__).resolve().parent.parent
    record = json.loads((root / "results/throughput/model-lra-table2-intel-xeon-2c/record.json").read_text())
    assert batches(record) == {1024: 32, 2048: 16, 3072: 8, 4096: 8}
    fig = family_panels(plt, record, [b for b in record["settings"]["backends"] if timed(record, b)])
    first = fig.axes[0]
    assert first.get_ylabel() == "train time per step / batch (s)"
    assert [t.get_text() for t in first.get_xticklabels()] == ["1K\nB=32", "2K\nB=16", "3K\nB=8", "4K\nB=8"]
    full = next(line for line in first.get_lines() if line.get_label() == "full")
    steps = {p["length"]: p["train"]["median_s"] / p["batch"] for p in timed(record, "full")}
    assert list(full.get_ydata()) == pytest.approx([steps[n] for n in full.get_xdata()])
    plt.close(fig)
    # one batch for every length, or no per-length batches (a batch searched per point): step time as measured
    assert batches({"per_length": [{"length": 1024, "batch": 8}, {"length": 2048, "batch": 8}]}) == {}
    assert batches({"points": []}) == {}


@pytest.mark.parametrize("power", [1, 2], ids=["linear", "quadratic"])
def test_slope_recovers_the_exponent(power: int) -> None:
    lengths = [1024, 4096, 16384, 65536]
    assert loglog_slope(lengths, [3e-9 * n**power for n in lengths]) == pytest.approx(power)


def test_slopes_of_a_record_divide_by_the_batch() -> None:
    def point(backend: str, n: int, batch: int, seconds: float) -> Dict[str, Any]:
        stats = {"median_s": seconds}
        return {"backend": backend, "length": n, "batch": batch, "status": "ok", "estimated": False,
                "forward": stats, "train": stats}

    # full: time per sequence ~ N^2 though the batch halves as N doubles; mita: ~ N
    points = [point("full", n, 64 // (n // 1024), 1e-6 * n**2 * (64 // (n // 1024))) for n in (1024, 2048, 4096)]
    points += [point("mita", n, 1, 1e-3 * n) for n in (1024, 2048, 4096)]
    points.append({"backend": "mita", "length": 8192, "batch": 1, "status": "oom", "estimated": False})
    got = slopes({"settings": {"backends": ["full", "mita"]}, "points": points})
    assert got["full"]["train"] == pytest.approx(2) and got["full"]["train_last_two"] == pytest.approx(2)
    assert got["mita"]["forward"] == pytest.approx(1) and got["mita"]["lengths"] == [1024, 2048, 4096]


def test_estimate_scales_slice_timings_linearly() -> None:
    stats = {"median_s": 0.5, "min_s": 0.25, "max_s": 1.0, "spread": 1.5, "repeats": 3, "times_s": [0.25, 0.5, 1.0]}
    scaled = scale_stats(stats, 16.0)
    assert (scaled["median_s"], scaled["min_s"], scaled["max_s"]) == (8.0, 4.0, 16.0)
    assert scaled["times_s"] == [4.0, 8.0, 16.0] and scaled["spread"] == 1.5 and scaled["repeats"] == 3


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    """run_point sets torch's thread count in this process; put it back after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def spec(level: str, **extra: Any) -> Dict[str, Any]:
    base = dict(level=level, backend="full", length=1024, batch=1, heads=2, head_dim=16, layers=2, width=32,
                ffn_dim=32, dropout=0.0, device="cpu", dtype="float32", budget_s=60.0, max_mem_gb=None, warmup=1,
                repeats=2, estimate="always", slice_queries=128, threads=1, gemm_size=0, seed=0, attn_options={})
    return {**base, **extra}


def test_attention_estimate_is_the_slice_times_n_over_s() -> None:
    result = run_point(spec("attention"))
    assert result["status"] == "estimated" and result["estimated"] and result["peak_mem_mb"] is None
    assert result["slice"]["scale"] == 8.0
    for mode in ("forward", "train"):
        assert result[mode]["median_s"] == pytest.approx(8.0 * result["slice"][mode]["median_s"])


def test_model_estimate_adds_the_rest_of_the_model_and_each_layer() -> None:
    result = run_point(spec("model", length=256, slice_queries=64))
    assert result["status"] == "estimated"
    info = result["slice"]
    for mode in ("forward", "train"):
        expected = info["rest"][mode]["median_s"] + 2 * 4.0 * info["attention"][mode]["median_s"]
        assert result[mode]["median_s"] == pytest.approx(expected)


def test_linear_backends_are_not_estimated() -> None:
    result = run_point(spec("attention", backend="linear", length=256))
    assert result["status"] == "ok" and not result["estimated"] and result["peak_mem_mb"] >= 0


@pytest.mark.parametrize("backend,exponent", [("full", 2), ("mita", 1)], ids=["full", "mita"])
def test_flop_counts_grow_with_the_cost_exponent(backend: str, exponent: int) -> None:
    small, large = attention_flops(backend, 2**14, 32, {}), attention_flops(backend, 2**16, 32, {})
    assert math.log(large[0] / small[0], 4) == pytest.approx(exponent)
    assert large[1] > 2 * large[0]


def test_batch_search_stops_at_an_estimate_and_at_no_gain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lra.bench import sweep as bench_sweep

    def fake_child(spec: Dict[str, Any], _workdir: Path) -> Dict[str, Any]:
        # throughput: estimated points are linear in the batch; ok points gain up to batch 4
        seconds = spec["batch"] * (1.0 if spec["backend"] == "full" else 1.0 / min(spec["batch"], 4))
        stats = {"median_s": seconds}
        status = "estimated" if spec["backend"] == "full" else "ok"
        return {"status": status, "estimated": status == "estimated", "forward": stats, "train": stats}

    monkeypatch.setattr(bench_sweep, "run_child", fake_child)
    settings = Settings(
        level="model", backends=["full"], lengths=[1024], device="cpu", dtype="float32", batch=None,
        heads=2, head_dim=16, layers=1, width=32, ffn_dim=32, dropout=0.0, budget_s=1.0, max_mem_gb=None,
        warmup=1, repeats=1, estimate="auto", slice_queries=256, threads=1, gemm_size=0, max_batch=64, min_gain=0.05,
    )
    estimated = bench_sweep.search_batch(settings, "full", 1024, tmp_path)
    assert [t["batch"] for t in estimated["batch_search"]] == [1] and estimated["batch"] == 1
    gaining = bench_sweep.search_batch(settings, "mita", 1024, tmp_path)
    assert [t["batch"] for t in gaining["batch_search"]] == [1, 2, 4, 8] and gaining["batch"] == 4


def test_lra_preset_sets_the_lra_shapes_and_flags_still_win(tmp_path: Path) -> None:
    # the preset's values (2 layers, width 64, 2 heads, FFN 128, padded batches of 8), lengths overridden
    record = bench(tmp_path, "model", "--preset", "lra", "--attn", "mita", "--lengths", "256", "--batch", "2",
                   "--gemm-size", "0")
    s = record["settings"]
    assert (s["layers"], s["width"], s["heads"], s["ffn_dim"], s["dropout"]) == (2, 64, 2, 128, 0.1)
    assert s["padded"] is True and s["batch"] == 2 and s["threads"] == 1 and s["lengths"] == [256]
    assert record["points"][0]["status"] == "ok"


def test_padded_model_workload_masks_rows_of_different_lengths() -> None:
    from lra.bench.workloads import build_model, model_modes

    spec = {"backend": "full", "heads": 2, "layers": 1, "width": 16, "ffn_dim": 16, "dropout": 0.0,
            "attn_options": {}, "length": 64, "batch": 4, "seed": 0, "padded": True}
    model = build_model(spec, torch.device("cpu"))
    calls = []
    model.encoder.blocks[0].attn.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["mask"]),
                                                       with_kwargs=True)
    model_modes(model, spec, torch.device("cpu"), torch.float32)["forward"]()
    mask = calls[0]
    assert mask is not None and bool(mask[0].all()) and not bool(mask.all())


def test_step_compare_times_every_backend_on_a_padded_batch() -> None:
    from attentions.backends.none import NoAttention

    module = load_script("step_compare")
    medians = module.compare(["full", "mita", "none"], n=128, batch=2, rounds=2, seed=0)
    assert set(medians) == {"full", "mita", "none"} and all(t > 0 for t in medians.values())
    # "none" (and its other name "floor") builds every attention as the none backend
    calls = []
    real = NoAttention.forward
    NoAttention.forward = lambda self, q, k, v, mask=None: calls.append(1) or real(self, q, k, v, mask)
    try:
        module.make_step("floor", 64, 1, 0)()
    finally:
        NoAttention.forward = real
    assert len(calls) == 2  # the encoder's two layers


def test_step_compare_times_a_compiled_model_beside_the_eager_one() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    module = load_script("step_compare")
    torch._dynamo.reset()
    counters.clear()
    medians = module.compare(["linear", "linear+compiled"], n=64, batch=2, rounds=1, seed=0, compiler="aot_eager")
    assert set(medians) == {"linear", "linear+compiled"} and all(t > 0 for t in medians.values())
    assert counters["stats"]["unique_graphs"] >= 1
