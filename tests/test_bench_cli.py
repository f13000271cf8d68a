"""The benchmark command end to end: it runs as a subprocess and its JSON holds every strategy's row."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remat_plugin.bench.__main__ import main

REPO = Path(__file__).resolve().parents[1]
PEERS = ["none", "per_layer", "sqrt_n"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "remat_plugin.bench", *args],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mlp_report(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _run("--model", "mlp-chain", "--budgets", "1.0,0.5", "--pairs", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_every_strategy_has_a_row(mlp_report):
    """One row per peer and per budget fraction, and the Markdown table names them all."""
    proc, report = mlp_report
    strategies = [row["strategy"] for row in report["rows"]]
    assert strategies == [*PEERS, "ours@1", "ours@0.5"]
    assert report["schema_version"] == 1 and report["settings"]["pairs"] == 2
    for strategy in strategies:
        assert f"| mlp-chain | {strategy} |" in proc.stdout


@pytest.mark.slow
def test_peers_match_none(mlp_report):
    """Peers report a measured peak, equal gradients, and none's own time ratio is about 1."""
    _, report = mlp_report
    rows = {row["strategy"]: row for row in report["rows"]}
    none_peak = rows["none"]["measured_peak_bytes"]
    assert none_peak > 0 and rows["none"]["none_peak_bytes"] == none_peak
    for name in PEERS:
        assert rows[name]["grads_equal"] is True
        assert 0 < rows[name]["measured_peak_bytes"] <= none_peak
        assert len(rows[name]["time_ratios"]) == 2
    # CPU steps of a few ms are noisy under load; a loose bound still catches a broken pairing.
    assert 0.25 < rows["none"]["time_ratio"] < 4


@pytest.mark.slow
def test_ours_fits_budget_or_says_infeasible(mlp_report):
    """Each ours row either fits its budget with equal gradients or is infeasible with the smallest budget."""
    _, report = mlp_report
    ours = [row for row in report["rows"] if row["strategy"].startswith("ours@")]
    none_peak = report["rows"][0]["measured_peak_bytes"]
    assert any(not row["infeasible"] for row in ours), "ours@1 (the unmodified peak) must be feasible"
    for row in ours:
        assert row["budget_bytes"] == int(row["budget_fraction"] * none_peak)
        if row["infeasible"]:
            assert row["min_feasible_bytes"] > row["budget_bytes"]
            assert row["measured_peak_bytes"] is None
            continue
        assert row["measured_peak_bytes"] <= row["budget_bytes"] and row["within_budget"] is True
        assert row["grads_equal"] is True
        assert row["predicted_peak_bytes"] <= row["budget_bytes"]
        assert row["plan_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed when there is no GPU")
def test_cuda_without_gpu_skips_cleanly(capsys):
    """``--device cuda`` on a machine without CUDA returns 0 with a message instead of failing."""
    assert main(["--model", "mlp-chain", "--device", "cuda"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "vgg"], "unknown model"),
        (["--model", "mlp-chain", "--budgets", "1.0,-0.5"], "positive fractions"),
        (["--model", "mlp-chain", "--budgets", "half"], "cannot read budgets"),
        (["--model", "mlp-chain", "--pairs", "0"], "--pairs must be at least 1"),
    ],
)
def test_bad_arguments_exit_with_usage(argv, message, capsys):
    """An unknown model or an unreadable budget is an argparse error (exit 2) naming the problem."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_n_layer_on_fixed_depth_model_is_refused(capsys):
    """``--n-layer`` with a model of fixed depth exits 2 and names the models that accept it."""
    with pytest.raises(SystemExit) as exc:
        main(["--model", "mlp-chain,resnet-tiny", "--n-layer", "2"])
    assert exc.value.code == 2
    assert "resnet-tiny have a fixed depth" in capsys.readouterr().err


def test_batch_shape_flags(capsys):
    """``--batch-size``/``--seq-len`` set a GPT-2 model's batch (GPT-2 small's shape run small on a CPU); a model of
    fixed shape is refused, naming the models that take them."""
    from remat_plugin.bench.run import run_bench

    rows = run_bench(["gpt2-tiny"], [1.0], pairs=1, n_layer=1, batch_size=2, seq_len=16)
    assert {(r["meta"]["batch_size"], r["meta"]["seq_len"]) for r in rows} == {(2, 16)}
    with pytest.raises(SystemExit) as exc:
        main(["--model", "gpt2-tiny,resnet-tiny", "--seq-len", "64"])
    assert exc.value.code == 2
    assert "resnet-tiny have a fixed batch shape; they apply to gpt2-tiny, gpt2-small" in capsys.readouterr().err


def test_recompute_breakdown_adds_up_to_the_plan():
    """``bench recompute-breakdown``: forward, backward and recomputed times are the plan's own prediction, the
    kinds add up to the forward, and the plan at per-layer checkpointing's measured peak stays under it."""
    from remat_plugin.bench.recompute_breakdown import op_kind, run

    r = run("mlp-chain", "per-layer")
    step = r["forward_ms"] + r["backward_ms"]
    assert (step + r["recomputed_ms"]) / step == pytest.approx(r["predicted_overhead"], rel=1e-9)
    assert r["recomputed_ms"] > 0 and r["measured_peak_bytes"] <= r["budget_bytes"]
    assert sum(k["fwd_ms"] for k in r["kinds"].values()) == pytest.approx(r["forward_ms"])
    assert sum(k["recomputed_ms"] for k in r["kinds"].values()) == pytest.approx(r["recomputed_ms"])
    assert op_kind("apply_dropout_mask_default_12") == "apply_dropout_mask" and op_kind("addmm_3") == "addmm"


def test_overhead_breakdown_sets_our_step_beside_eagers():
    """``bench overhead-breakdown``: with nothing recomputed, the split dropouts and our autograd nodes appear in our
    step only, once per dropout and per step, eager's own dropout only in eager's, the draws and the matrix
    products alike."""
    from remat_plugin.bench.overhead_breakdown import report, run

    r = run("mlp-chain", 1.0, steps=2, pairs=3, n_blocks=3)
    events = {row["event"]: row for row in r["events"]}
    assert r["predicted_overhead"] == pytest.approx(1.0)
    for op in ("remat_plugin::dropout_mask", "remat_plugin::apply_dropout_mask", "remat_plugin::dropout_mask_backward"):
        assert (events[op]["ours_calls"], events[op]["eager_calls"]) == (3, 0), op
    assert events["aten::dropout"]["ours_calls"] == 0 and events["aten::dropout"]["eager_calls"] == 3
    assert events["aten::bernoulli_"]["ours_calls"] == events["aten::bernoulli_"]["eager_calls"] == 3
    assert events["CompiledFunction"]["ours_calls"] == 1 and events["CompiledFunction"]["eager_calls"] == 0
    assert events["aten::mm"]["ours_calls"] == events["aten::mm"]["eager_calls"] > 0
    assert r["wall_ms"]["ours"] > 0 and r["wall_ms"]["eager"] > 0 and "mlp-chain at 1" in report(r)


def test_overhead_breakdown_at_per_layer_checkpointings_peak():
    """``--budget per-layer``: planned for per-layer checkpointing's measured peak, below the unmodified one, so
    the plan recomputes (issue 15's low-budget point), and timed beside that peer."""
    from remat_plugin.bench.overhead_breakdown import report, run

    r = run("mlp-chain", "per-layer", steps=1, pairs=1, n_blocks=3)
    assert 0 < r["budget_bytes"] < r["none_peak_bytes"], r
    assert r["predicted_overhead"] > 1.0
    # the peer runs in the same rotation, and the report sets ours beside it
    assert r["wall_ms"]["per_layer"] > 0 and r["peer_ratio"] == r["wall_ms"]["per_layer"] / r["wall_ms"]["eager"]
    assert "at per-layer checkpointing's peak" in report(r) and "per-layer checkpointing in the same rotation" in report(r)
