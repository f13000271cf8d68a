"""The compare command: a reduced run end to end, and the pieces it is built from."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from remat_plugin.bench.__main__ import main
from remat_plugin.bench.compare import POINT_FIELDS, CompareSettings, _downsample, _ours_budgets
from remat_plugin.bench.models import build
from remat_plugin.bench.peers import compiled_memory_budget, none
from remat_plugin.bench.report import frontier_comparison

REPO = Path(__file__).resolve().parents[1]
MODELS = ["mlp-chain", "resnet-tiny"]
STRATEGIES = {"none", "per_layer", "sqrt_n", "drop_cheap", "compile", "ours"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, dict]:
    out = tmp_path_factory.mktemp("compare")
    proc = subprocess.run(
        [sys.executable, "-m", "remat_plugin.bench", "compare", "--models", ",".join(MODELS),
         "--budgets", "1.0,0.6", "--pairs", "1", "--amb-ratios", "0.5", "--threads", "1", "--out", str(out)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out, json.loads((out / "compare_cpu.json").read_text())


@pytest.mark.slow
def test_writes_table_json_and_both_plots(compare_run):
    """The Markdown table, the JSON and both PNGs are written, and the table names every point."""
    proc, out, payload = compare_run
    for suffix in (".frontier.png", ".timeline.png"):
        data = (out / f"compare_cpu{suffix}").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    table = (out / "compare_cpu.md").read_text()
    assert table == proc.stdout[: len(table)]
    for point in payload["points"]:
        assert f"| {point['model']} | {point['label']} |" in table
    assert "## Against each peer at equal measured peak" in table


@pytest.mark.slow
def test_every_point_has_every_field(compare_run):
    """Every point of every model carries all of POINT_FIELDS, and every strategy is there."""
    _, _, payload = compare_run
    assert payload["schema_version"] == 1 and payload["settings"]["pairs"] == 1
    for model in MODELS:
        points = [p for p in payload["points"] if p["model"] == model]
        assert {p["strategy"] for p in points} == STRATEGIES
        for point in points:
            assert set(POINT_FIELDS) <= set(point), set(POINT_FIELDS) - set(point)


@pytest.mark.slow
def test_points_are_measured_with_the_right_meter(compare_run):
    """Eager points have both meters and exact gradients; compiled ones only the profiler; ours fits its budget."""
    _, _, payload = compare_run
    for point in payload["points"]:
        if point["infeasible"]:
            assert point["min_feasible_bytes"] > point["budget_bytes"] and point["measured_peak_bytes"] is None
            continue
        assert point["error"] is None, point["error"]
        assert point["meter"] == "profiler" and point["measured_peak_bytes"] > 0
        assert len(point["time_ratios"]) == 1 and point["time_ratio"] > 0
        if point["strategy"] == "compile":
            assert point["dispatch_peak_bytes"] is None and point["plan_s"] > 0 and point["setting"] == 0.5
            continue
        assert point["dispatch_peak_bytes"] > 0 and point["grads_exact"] is True
        if point["strategy"] == "ours":
            # The plan's contract is on the dispatch meter; the profiler also sees oneDNN convolution
            # scratch the planner does not model, so only the convolution-free model must fit by both.
            assert point["dispatch_peak_bytes"] <= point["budget_bytes"] and point["plan_s"] > 0
            assert point["predicted_peak_bytes"] <= point["budget_bytes"]
            assert point["within_budget"] is (point["measured_peak_bytes"] <= point["budget_bytes"])
            if point["model"] == "mlp-chain":
                assert point["within_budget"] is True


@pytest.mark.slow
def test_ours_is_planned_at_the_peers_peaks_and_compared(compare_run):
    """Ours has a budget equal to a peer's measured peak, and each peer point gets one comparison."""
    _, _, payload = compare_run
    peaks = {(p["model"], p["label"]): p["measured_peak_bytes"] for p in payload["points"]}
    matched = [p for p in payload["points"] if p["strategy"] == "ours" and p["matched_to"]]
    assert matched
    for point in matched:
        assert point["budget_bytes"] == min(peaks[point["model"], peer] for peer in point["matched_to"])
    peer_points = [p for p in payload["points"] if p["strategy"] not in ("none", "ours")]
    assert len(payload["comparisons"]) == len(peer_points)


@pytest.mark.slow
def test_timelines_have_measured_and_predicted_series(compare_run):
    """Each model's timeline holds none measured and, with a feasible plan, ours measured and predicted."""
    _, _, payload = compare_run
    for model in MODELS:
        timeline = payload["timelines"][model]
        assert "none measured" in timeline["series"]
        if "ours_label" in timeline:
            assert {"ours measured", "ours predicted", "keep-all predicted"} <= set(timeline["series"])
        for series in timeline["series"].values():
            assert len(series["x"]) == len(series["bytes"]) > 0
            assert 0 <= series["fwd_end_x"] <= 1 and max(series["bytes"]) > 0


def test_compiled_peer_matches_none_and_resets():
    """torch.compile at activation_memory_budget 1.0 gives none's loss, and the config is restored after."""
    bench = build("mlp-chain", batch_size=16, width=64)
    args, kwargs = bench.make_batch(0)
    with none(bench) as step:
        torch.manual_seed(0)
        reference = step(args, kwargs)
    with compiled_memory_budget(bench, 0.25) as step:
        assert torch._functorch.config.activation_memory_budget == 0.25
        torch.manual_seed(0)
        loss = step(args, kwargs)
        loss.backward()
    assert torch._functorch.config.activation_memory_budget == 1.0
    assert torch.allclose(loss, reference)
    with pytest.raises(ValueError, match="must lie in"), compiled_memory_budget(bench, 1.5):
        pass


def test_ours_budgets_merge_and_skip():
    """Peers within 1% share one budget (the lower peak); a fraction within 3% of a peer's peak is skipped."""
    ctx = SimpleNamespace(settings=CompareSettings(models=("m",), fractions=(1.0, 0.5, 0.3)), none_peak=1000)
    peers = [
        {"strategy": "none", "label": "none", "measured_peak_bytes": 1000},
        {"strategy": "per_layer", "label": "per_layer", "measured_peak_bytes": 300},
        {"strategy": "drop_cheap", "label": "drop_cheap", "measured_peak_bytes": 302},
        {"strategy": "compile", "label": "compile@0.5", "measured_peak_bytes": 600},
        {"strategy": "compile", "label": "compile@0.3", "measured_peak_bytes": None},
    ]
    budgets = _ours_budgets(ctx, peers)
    assert budgets == [
        (1000, "ours@1", []),
        (600, "ours@compile@0.5", ["compile@0.5"]),
        (500, "ours@0.5", []),
        (300, "ours@drop_cheap+per_layer", ["drop_cheap", "per_layer"]),
    ]


def _point(strategy, label, peak, ratio, grads_equal=True, matched_to=None):
    return {"model": "m", "strategy": strategy, "label": label, "measured_peak_bytes": peak, "time_ratio": ratio,
            "grads_equal": grads_equal, "none_peak_bytes": 100, "matched_to": matched_to}  # fmt: skip


def test_frontier_comparison_verdicts():
    """Ours planned at the peer's peak is compared, else the fastest below it; compile gets the 5% allowance."""
    points = [
        _point("none", "none", 100, 1.0),
        _point("per_layer", "per_layer", 30, 1.4),
        _point("sqrt_n", "sqrt_n", 60, 1.4),
        _point("compile", "compile@0.7", 50, 1.0),
        _point("compile", "compile@0.1", 20, 1.0),
        _point("ours", "ours@a", 29, 1.3),
        _point("ours", "ours@b", 45, 1.04),
        _point("ours", "ours@sqrt_n", 58, 1.2, matched_to=["sqrt_n"]),
        _point("ours", "ours@c", 10, 0.5, grads_equal=False),
    ]
    found = {c["peer"]: c for c in frontier_comparison(points)}
    assert found["per_layer"]["ours"] == "ours@a" and found["per_layer"]["verdict"] == "ours faster"
    assert found["sqrt_n"]["ours"] == "ours@sqrt_n"  # not ours@b, faster but chosen after the fact
    assert found["compile@0.7"]["ours"] == "ours@b" and found["compile@0.7"]["verdict"] == "ours within 5%"
    assert found["compile@0.1"]["ours"] is None and "cannot reach" in found["compile@0.1"]["verdict"]


def test_downsample_keeps_the_peak():
    """Downsampling a timeline keeps at most n samples and never loses the maximum."""
    x = [i / 999 for i in range(1000)]
    y = [i % 97 for i in range(1000)]
    y[501] = 10_000
    xs, ys = _downsample(x, y, 50)
    assert len(xs) == len(ys) == 50 and max(ys) == 10_000 and xs[ys.index(10_000)] == x[501]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed when there is no GPU")
def test_compare_cuda_without_gpu_skips_cleanly(capsys):
    """``compare --device cuda`` on a machine without CUDA returns 0 with a message."""
    assert main(["compare", "--models", "mlp-chain", "--device", "cuda"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "vgg"], "unknown model"),
        (["--amb-ratios", "0.5,1.5"], "must lie in [0, 1]"),
        (["--pairs", "0"], "--pairs must be at least 1"),
    ],
)
def test_compare_bad_arguments_exit_with_usage(argv, message, capsys):
    """Bad compare arguments are argparse errors (exit 2) that name the problem."""
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
