"""RematSession: which plan serves which call, budgets, persistence; and the config it reads."""
from __future__ import annotations

import logging

import pytest
import torch

from remat_plugin.bench.models import mlp_chain
from remat_plugin.errors import BudgetFormatError, InfeasibleBudgetError
from remat_plugin.runtime.config import ConfigError, RematConfig
from remat_plugin.runtime.optimizer_state import pending_state_bytes
from remat_plugin.runtime.resolver import MANY_SHAPES
from remat_plugin.runtime.session import RematSession
from remat_plugin.runtime.signature import Signature, bucketed_inputs, describe, round_length


def _session(bench, budget=10**12, **config):
    session = RematSession(bench.module, RematConfig(budget=budget, ilp_time_limit_s=0.2, **config))
    bench.module.forward = session.dispatcher(bench.module.forward)
    return session


def test_round_length_policies():
    """pow2, multiples and exact lengths; anything else is refused."""
    assert [round_length(n, "pow2") for n in (1, 2, 3, 64, 65, 200)] == [1, 2, 4, 64, 128, 256]
    assert [round_length(n, 64) for n in (1, 64, 65)] == [64, 64, 128]
    assert round_length(100, None) == 100
    with pytest.raises(ValueError, match="seq_bucket"):
        round_length(10, "fibonacci")


def test_buckets_round_token_lengths_only_and_cover_smaller_calls():
    """Integer (token) inputs grow to the bucket, float features do not; a bucket covers shorter and smaller calls."""
    module = torch.nn.Linear(3, 3)
    ids, feats = torch.ones(4, 100, dtype=torch.long), torch.ones(4, 100, 3)
    b_args, b_kwargs, changed = bucketed_inputs((ids,), {"f": feats}, "pow2")
    assert changed and b_args[0].shape == (4, 128) and b_kwargs["f"].shape == (4, 100, 3)
    assert not bucketed_inputs((ids[:, :64],), {}, "pow2")[2]
    big = Signature.of(module, (torch.ones(8, 128, dtype=torch.long),), {})
    assert big.covers(Signature.of(module, (ids,), {}))
    assert big.covers(Signature.of(module, (torch.ones(3, 128, dtype=torch.long),), {}))  # last partial batch
    assert not big.covers(Signature.of(module, (torch.ones(16, 64, dtype=torch.long),), {}))  # larger batch
    assert not big.covers(Signature.of(module, (torch.ones(8, 128, dtype=torch.int32),), {}))  # other dtype
    assert describe(big.key) == "8x128 int64"
    assert Signature.of(module, (ids,), {"n": torch.tensor(3.0)}).describe() == "4x100 int64, scalar float32"


def test_eval_and_no_grad_calls_never_plan():
    """Only training calls with gradients plan; eval and no_grad run the original forward."""
    bench = mlp_chain(n_blocks=2, width=64, batch_size=8)
    session = _session(bench)
    args, _ = bench.make_batch(0)
    bench.module.eval()
    bench.module(*args)
    bench.module.train()
    with torch.no_grad():
        bench.module(*args)
    assert session.n_solved == 0 and not session.plans
    bench.module(*args).backward()
    assert session.n_solved == 1


def test_smaller_batch_replays_and_gradients_match():
    """The last partial batch replays the full batch's plan (no solve) with the original module's gradients."""
    bench, ref = (mlp_chain(n_blocks=6, width=64, batch_size=512, dtype=torch.float64) for _ in range(2))
    x, y = bench.make_batch(0)[0]
    plain_peak = _peak(lambda: ref.module(x, y).backward())
    ref.module.zero_grad()
    session = _session(bench, budget=int(plain_peak * 0.6))
    for n in (512, 512, 300):
        torch.manual_seed(n)
        bench.module(x[:n], y[:n]).backward()
        torch.manual_seed(n)
        ref.module(x[:n], y[:n]).backward()
        for p, q in zip(bench.module.parameters(), ref.module.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert (session.n_solved, session.n_replayed) == (1, 1)
    assert any(b.mode != "keep" for b in session.plans[next(iter(session.plans))].blocks)


def test_many_input_shapes_are_told_once_with_the_fix(caplog):
    """Each new input shape captures its own step (NOTE [many shapes]); the caller is told once, at the
    MANY_SHAPES-th, how to avoid it, and the replayed steps keep the original module's gradients."""
    bench, ref = (mlp_chain(n_blocks=2, width=32, batch_size=64, dtype=torch.float64) for _ in range(2))
    x, y = bench.make_batch(0)[0]
    session = _session(bench)
    sizes = range(64, 64 - MANY_SHAPES - 2, -1)
    told_after = []
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        for n in sizes:
            for module in (bench.module, ref.module):
                module.zero_grad(set_to_none=True)
                torch.manual_seed(n)
                module(x[:n], y[:n]).backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(bench.module.parameters(), ref.module.parameters()))
            told_after.append(sum("different input shapes" in r.getMessage() for r in caplog.records))
        bench.module(x, y).backward()  # a shape met before: its step runs, nothing is said
    assert told_after == [0] * (MANY_SHAPES - 1) + [1] * (len(sizes) - MANY_SHAPES + 1)
    assert sum("different input shapes" in r.getMessage() for r in caplog.records) == 1
    message = next(r.getMessage() for r in caplog.records if "different input shapes" in r.getMessage())
    assert f"{MANY_SHAPES} different input shapes" in message and "pad_to_multiple_of" in message
    assert (session.n_solved, session.n_replayed) == (1, len(sizes) - 1)


def _peak(fn):
    from remat_plugin.capture.memory_meter import measure_peak

    return measure_peak(fn)[1]


def test_plans_persist_through_state_dict_and_cache_dir(tmp_path):
    """A new session with the old one's state, or the same cache directory, replays instead of solving."""
    args = mlp_chain(n_blocks=2, width=64, batch_size=8).make_batch(0)[0]
    first = mlp_chain(n_blocks=2, width=64, batch_size=8)
    session = _session(first, cache_dir=str(tmp_path))
    first.module(*args).backward()
    assert session.n_solved == 1 and len(list(tmp_path.glob("plan-*.json"))) == 1

    from_state = mlp_chain(n_blocks=2, width=64, batch_size=8)
    s2 = _session(from_state)
    s2.load_state_dict(session.state_dict())
    from_state.module(*args).backward()
    from_disk = mlp_chain(n_blocks=2, width=64, batch_size=8)
    s3 = _session(from_disk, cache_dir=str(tmp_path))
    from_disk.module(*args).backward()
    assert (s2.n_solved, s2.n_replayed, s3.n_solved, s3.n_replayed) == (0, 1, 0, 1)

    other = mlp_chain(n_blocks=3, width=64, batch_size=8)  # another model: its plans are not these
    s4 = _session(other)
    s4.load_state_dict(session.state_dict())
    assert not s4.plans


def test_budget_leaves_room_for_optimizer_state_not_yet_created():
    """Adam's two moments come out of the budget until they exist; an optimizer alone over budget is named."""
    bench = mlp_chain(n_blocks=2, width=64, batch_size=8)
    params = list(bench.module.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    opt = torch.optim.AdamW(params)
    session = RematSession(bench.module, RematConfig(budget=10 * param_bytes), optimizers=lambda: [opt])
    args = bench.make_batch(0)[0]
    assert session.training_budget(args, {}) == 8 * param_bytes
    bench.module(*args).backward()
    opt.step()
    assert pending_state_bytes([opt]) == 0 and session.training_budget(args, {}) == 10 * param_bytes
    small = RematSession(bench.module, RematConfig(budget=param_bytes),
                         optimizers=lambda: [torch.optim.Adam(params)])
    with pytest.raises(InfeasibleBudgetError, match="optimizer state"):
        small.training_budget(args, {})


def test_config_rejects_unknown_keys_and_reads_the_environment():
    """Unknown options are named; REMAT_* variables fill options; a bad REMAT_BUDGET is named with the fix."""
    with pytest.raises(ConfigError, match="unknown option.*'budgett'"):
        RematConfig.from_dict({"budgett": "80%"})
    config = RematConfig.from_env({"REMAT_BUDGET": "12GiB", "REMAT_SEQ_BUCKET": "64", "REMAT_CACHE_DIR": "/tmp/p"})
    assert (config.budget, config.seq_bucket, config.cache_dir) == ("12GiB", 64, "/tmp/p")
    assert RematConfig.from_env({"REMAT_BUDGET": "1000"}).budget == 1000
    assert RematConfig.from_env({"REMAT_BUDGET": "1000"}, budget="2GiB").budget == "2GiB"
    with pytest.raises(BudgetFormatError, match="REMAT_BUDGET.*eighty.*'80%'"):
        RematConfig.from_env({"REMAT_BUDGET": "eighty"})
    with pytest.raises(ConfigError, match="seq_bucket"):
        RematConfig(seq_bucket="fibonacci")


def test_config_reads_every_option_from_its_variable_and_errors_carry_fields():
    """Each option has one REMAT_* variable (the batch size limits under their own names), read once, blank as unset;
    an argument wins without its variable being read; an error names option, variable, text and the fix."""
    import dataclasses

    from remat_plugin.runtime.config import ENV_VARIABLES

    assert set(ENV_VARIABLES) == {f.name for f in dataclasses.fields(RematConfig)}
    config = RematConfig.from_env({"REMAT_AUTO_BATCH_SIZE": "TRUE", "REMAT_BATCH_MULTIPLE_OF": "8",
                                   "REMAT_MAX_BATCH_SIZE": "64", "REMAT_SEQ_BUCKET": "exact", "REMAT_BUDGET": " "})
    assert (config.auto_batch_size, config.multiple_of, config.max_val) == ("max", 8, 64)
    assert (config.seq_bucket, config.budget) == (None, "80%")
    assert RematConfig.from_env({"REMAT_AUTO_BATCH_SIZE": "throughput"}).auto_batch_size == "throughput"
    assert RematConfig.from_env({"REMAT_AUTO_BATCH_SIZE": "no"}).auto_batch_size is False
    assert RematConfig(auto_batch_size=True).auto_batch_size == "max"
    assert RematConfig.from_env({"REMAT_ILP_TIME_LIMIT_S": "soon"}, ilp_time_limit_s=0.3).ilp_time_limit_s == 0.3
    with pytest.raises(ConfigError, match=r"REMAT_BATCH_MULTIPLE_OF='0' is invalid.*unset it for the default \(1\)"
                       ) as err:
        RematConfig.from_env({"REMAT_BATCH_MULTIPLE_OF": "0"})
    assert (err.value.option, err.value.variable, err.value.value) == ("multiple_of", "REMAT_BATCH_MULTIPLE_OF", "0")
    with pytest.raises(BudgetFormatError) as budget_err:
        RematConfig(budget="eighty")
    assert (budget_err.value.option, budget_err.value.value, budget_err.value.variable) == ("budget", "eighty", None)
    assert "'80%'" in budget_err.value.detail and "remat_plugin" not in budget_err.value.detail
    with pytest.raises(ConfigError, match=r"max_val 4 \(REMAT_MAX_BATCH_SIZE\) must be an integer >= multiple_of"):
        RematConfig(multiple_of=8, max_val=4)


def test_remat_yaml_lists_every_option_with_its_default():
    """configs/remat.yaml is RematConfig's defaults, key for key."""
    import dataclasses
    from pathlib import Path

    from omegaconf import OmegaConf

    values = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "configs" / "remat.yaml"))
    assert set(values) == {f.name for f in dataclasses.fields(RematConfig)}
    assert RematConfig.from_dict(values) == RematConfig()


def test_session_plan_is_the_plan_of_the_latest_call():
    """Going back to an earlier shape reports that shape's plan again."""
    bench = mlp_chain(n_blocks=2, width=64, batch_size=16)
    session = _session(bench)
    (x, y), _ = bench.make_batch(0)
    bench.module(x, y).backward()
    first = session.plan
    bench.module(torch.cat([x, x]), torch.cat([y, y])).backward()  # a larger batch: a new plan
    assert session.plan is not first
    bench.module(x, y).backward()
    assert session.plan is first


def test_a_changing_python_argument_is_told_at_its_second_value(caplog):
    """A Python number in the call is a constant of the traced graph (NOTE [Python values in a call]): a new value
    captures and plans again, so the caller is told once, at the second value, which argument and the fix.  Each
    value's step has the original module's gradients."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))

        def forward(self, x, scale: float, tag: str = "train"):
            return (self.layers(x) * scale).square().sum()

    model, ref = Scaled().double(), Scaled().double()
    session = RematSession(model, RematConfig(budget=10**12, ilp_time_limit_s=0.2))
    model.forward = session.dispatcher(model.forward)
    x = torch.randn(8, 16, dtype=torch.float64)
    told = []
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        for scale in (1.0, 1.0, 0.5, 0.25, 1.0):
            for module in (model, ref):
                module.zero_grad(set_to_none=True)
                module(x, scale=scale).backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
            told.append([r.getMessage() for r in caplog.records if "Python argument" in r.getMessage()])
    assert [len(t) for t in told] == [0, 0, 1, 1, 1]  # said once, at the second value; the same tag never
    message = told[-1][0]
    assert "kwargs['scale'] (0.5, first 1.0)" in message and "torch.tensor" in message
    assert session.n_solved == 3  # one plan per value: what the warning is about


class _NeedsAnImageToken(torch.nn.Module):
    """Raises on a batch without its image token, as a vision-language model does (SmolVLM: "Image features and
    image tokens do not match"), and selects by a boolean mask (exported, but no graph: the fallback)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))

    def forward(self, ids):
        torch._check_tensor_all_with(ValueError, (ids == 5).any(), lambda: "image tokens do not match: 0")
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return h.square().mean() + h[h > 0].sum()


def test_a_model_refusing_its_bucket_s_padding_is_planned_at_its_own_shapes(caplog):
    """The bucket's zero padding holds no image token: the model raises on it, and the call used to fail with that
    error; its exact shapes are planned instead, the bucket tried once."""
    torch.manual_seed(0)
    model = _NeedsAnImageToken()
    session = RematSession(model, RematConfig(budget=10**9, ilp_time_limit_s=0.2))
    model.forward = session.dispatcher(model.forward)
    with caplog.at_level(logging.INFO, logger="remat_plugin"):
        for length in (37, 41):  # both in the bucket of 64
            ids = torch.randint(6, 16, (2, length))
            ids[:, 3] = 5
            model(ids).backward()
    assert session.plan is not None and session.plan.fallback
    assert sum("could not be planned (ValueError: image tokens do not match" in r.getMessage()
               for r in caplog.records) == 1


class _BranchyTokens(torch.nn.Module):
    """Token ids in, a branch on a value (no graph: the metered fallback), 512-wide layers."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 64)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)) for _ in range(4))

    def forward(self, ids):
        h = self.embed(ids)
        if h.mean() > 10:
            h = h * 2
        for layer in self.layers:
            h = h + layer(h)
        return h.square().mean()


def test_a_metered_fallback_serves_the_calls_of_its_bucket(caplog):
    """NOTE [metered fallback] with buckets: the bucket's padded step is metered once, and shorter calls in it run
    its choice with no new export or metering, each within the budget and bitwise the unmodified model's."""
    import copy

    from remat_plugin.capture.memory_meter import measure_peak_profiler

    torch.manual_seed(0)
    model = _BranchyTokens().double()
    reference = copy.deepcopy(model)
    budget = 12 * 2**20  # 8x64 tokens: the unmodified step measures 19.5 MiB, every layer checkpointed 5.6 MiB
    session = RematSession(model, RematConfig(budget=budget, ilp_time_limit_s=0.2))
    model.forward = session.dispatcher(model.forward)
    with caplog.at_level(logging.INFO, logger="remat_plugin"):
        for length in (37, 41, 50, 64):  # all in the bucket of 64
            ids = torch.randint(0, 16, (8, length))
            for m in (model, reference):
                m.zero_grad(set_to_none=True)
                m(ids).backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
            model.zero_grad(set_to_none=True)
            assert measure_peak_profiler(lambda ids=ids: model(ids).backward())[1] <= budget, length
    said = [r.getMessage() for r in caplog.records]
    assert sum("fallback checkpoints" in m for m in said) == 1, said  # metered once, at 8x64
    assert sum("could not capture" in m for m in said) == 1, said  # exported once, not per length
    assert 0 < sum(b.mode == "checkpoint" for b in session.plan.blocks) <= 4
