"""rematerialize() against plain PyTorch as the oracle: outputs, gradients, buffers, memory, errors."""
import copy
import logging

import pytest
import torch
from budgets import settle, sweep
from model_factories import ResidualLayers
from torch import nn

from remat_plugin import CaptureError, InfeasibleBudgetError, rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import measure_peak, measure_peak_profiler
from remat_plugin.ir.plan import budget_for_peak

SMALL = {
    "gpt2-tiny": {"n_layer": 2, "batch_size": 4, "seq_len": 64},
    "mlp-chain": {},
    "resnet-tiny": {},
}


def _pair(name, dtype=torch.float64):
    """Two identical models: one to rewrite, one to run unmodified."""
    a = build(name, dtype=dtype, seed=0, **SMALL[name])
    b = build(name, dtype=dtype, seed=0, **SMALL[name])
    return a, b


def _step(module, bench, batch, seed=123):
    args, kwargs = batch
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = bench.loss(module(*args, **kwargs))
    loss.backward()
    return loss.detach()


def _baseline_peak(bench, batch):
    return measure_peak(lambda: _step(bench.module, bench, batch))[1]


def _assert_same_step(rm, a, b, batch, exact=True):
    loss_a = _step(rm, a, batch)
    loss_b = _step(b.module, b, batch)
    cmp = torch.equal if exact else (lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-7))
    assert cmp(loss_a, loss_b), (loss_a, loss_b)
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert cmp(pa.grad, pb.grad), f"gradient of {name} differs"
    for (name, ba), bb in zip(a.module.named_buffers(), b.module.buffers()):
        assert torch.equal(ba, bb), f"buffer {name} differs"


@pytest.mark.parametrize("name", ["gpt2-tiny", "mlp-chain", "resnet-tiny"])
def test_float64_bitwise_from_baseline_to_smallest_budget(name):
    """Loss, gradients and BatchNorm buffers equal plain PyTorch bitwise (float64, dropout on) at every budget."""
    a, b = _pair(name)
    batch = a.make_batch(0)
    plan = rematerialize(a.module, *batch, budget=10**12).plan
    base, floor = budget_for_peak(plan.baseline_peak_bytes), plan.min_feasible_bytes
    assert floor < base
    n = 3 if name == "gpt2-tiny" else 6  # every budget from the baseline down to the smallest feasible
    budgets = [base - (base - floor) * i // (n - 1) for i in range(n)]
    for budget in budgets:
        rm = rematerialize(a.module, *batch, budget=budget)
        assert rm.plan.predicted_peak_bytes <= budget
        _assert_same_step(rm, a, b, batch)
        _assert_same_step(rm, a, b, batch)  # second step: buffers updated once per step, dropout still matches


def test_float32_within_tolerance():
    """float32 gradients match within 1e-5 relative."""
    a, b = _pair("gpt2-tiny", torch.float32)
    batch = a.make_batch(1)
    plan = rematerialize(a.module, *batch, budget=10**12).plan
    rm = rematerialize(a.module, *batch, budget=(plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2)
    assert any(b.mode != "keep" for b in rm.plan.blocks)
    _assert_same_step(rm, a, b, batch, exact=False)


@pytest.mark.parametrize("name", ["gpt2-tiny", "mlp-chain", "resnet-tiny"])
def test_budget_sweep_measured_within_budget_and_prediction(name):
    """6-point sweep, float32, measured at the CPU allocator (profiler events, oneDNN scratch included): peak ≤
    budget at every point; prediction within 5% of the meter once the plan has settled (gpt2-tiny's loop keeps
    only the loss: its logits are freed after the forward from the second step on, NOTE [output usage])."""
    a, _ = _pair(name, torch.float32)
    batch = a.make_batch(0)
    plan = rematerialize(a.module, *batch, budget=10**12).plan
    for i, budget in enumerate(sweep(plan)):
        rm = rematerialize(a.module, *batch, budget=budget)
        settle(lambda rm=rm: _step(rm, a, batch))  # first calls plan, build and calibrate: not the step's memory
        a.module.zero_grad(set_to_none=True)  # as a training loop does before the step: not inside the meter
        measured = measure_peak_profiler(lambda rm=rm: _step(rm, a, batch))[1]
        assert measured <= budget, (i, measured, budget)
        predicted = rm.plan.predicted_peak_bytes
        assert abs(predicted - measured) <= 0.05 * measured, (i, predicted, measured)


def test_infeasible_budget_names_smallest_feasible():
    """A budget below the smallest feasible raises with that budget in bytes and human units; it then works."""
    a, _ = _pair("mlp-chain", torch.float32)
    batch = a.make_batch(0)
    with pytest.raises(InfeasibleBudgetError, match=r"smallest feasible budget is \d+ bytes \(\d+\.\d+ [KM]iB\)") as err:
        rematerialize(a.module, *batch, budget=1000)
    floor = err.value.min_feasible_bytes
    rm = rematerialize(a.module, *batch, budget=floor)
    assert rm.plan.predicted_peak_bytes <= floor


class _FrozenWideHead(nn.Module):
    """A small trained body under a frozen 32 MiB output layer (an LM head kept fixed while fine-tuning):
    the step needs far less than that weight, so a copy of it made while profiling would show."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 131072).requires_grad_(False)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def test_planning_itself_stays_within_budget(monkeypatch):
    """rematerialize() from cold (no op measurement cached: capture, profile every op, solve, first step) never
    raises the CPU allocator's total above the budget, on a model whose largest op reads a 32 MiB weight:
    profiling reads the real parameters instead of copies (NOTE [temporary memory], measured_costs.py)."""
    from remat_plugin.capture.memory_meter import measure_peak_profiler
    from remat_plugin.runtime import module as remat_module
    from remat_plugin.runtime.steps import PlanningCaches

    torch.manual_seed(0)
    model = _FrozenWideHead()
    x, y = torch.randn(8, 64), torch.randint(0, 131072, (8,))
    plan = rematerialize(model, (x, y), {}, budget=10**12).plan
    weight_bytes = model.head.weight.numel() * 4
    budget = plan.baseline_peak_bytes + weight_bytes // 4
    assert budget < weight_bytes  # one more copy of the weight would not fit
    monkeypatch.setattr(remat_module, "PROCESS_CACHES", PlanningCaches())  # cold: every op is profiled again

    def plan_and_step():
        rm = rematerialize(model, (x, y), {}, budget=budget)
        rm(x, y).backward()

    model.zero_grad(set_to_none=True)
    planning_peak = measure_peak_profiler(plan_and_step)[1]
    assert planning_peak <= budget, (planning_peak, budget, weight_bytes)


def test_eval_and_no_grad_run_original_and_keep_output_type():
    """Eval mode and no_grad run the original forward; an HF ModelOutput stays a ModelOutput."""
    a, _ = _pair("gpt2-tiny", torch.float32)
    args, kwargs = a.make_batch(0)
    rm = rematerialize(a.module, args, kwargs, budget=10**10)
    out = rm(*args, **kwargs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    n_plans = len(rm.steps)
    with torch.no_grad():
        ref = a.module.eval()(**kwargs)
        rm.eval()
        got = rm(**kwargs)
    assert type(got) is type(ref) and torch.equal(got.logits, ref.logits)
    rm.train()
    with torch.no_grad():
        rm(**{**kwargs, "input_ids": kwargs["input_ids"][:, :16], "labels": kwargs["labels"][:, :16]})
    assert len(rm.steps) == n_plans, "no-grad calls must not plan"


def test_parameters_and_state_dict_are_the_originals():
    """The rewritten module shares Parameter objects and state_dict keys with the original."""
    a, _ = _pair("resnet-tiny", torch.float32)
    rm = rematerialize(a.module, *a.make_batch(0), budget=10**10)
    assert rm.original is a.module
    assert list(rm.state_dict()) == list(a.module.state_dict())
    assert all(p is q for p, q in zip(rm.parameters(), a.module.parameters()))
    clone = copy.deepcopy(a.module.state_dict())
    rm.load_state_dict(clone)


def test_attributes_it_lacks_are_the_originals():
    """``rm.config``, ``rm.lm_head`` and ``rm.generate`` are the original's (a drop-in for ``model``); a name neither
    has still raises AttributeError."""
    a, _ = _pair("gpt2-tiny", torch.float32)
    args, kwargs = a.make_batch(0)
    rm = rematerialize(a.module, args, kwargs, budget=10**10, verbose=False)
    assert rm.config is a.module.config and rm.lm_head is a.module.lm_head
    rm.eval()
    prompt = kwargs["input_ids"][:1, :4]
    assert torch.equal(rm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False),
                       a.module.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                         do_sample=False))
    with pytest.raises(AttributeError, match="no_such_attribute"):
        rm.no_such_attribute  # noqa: B018


def test_without_example_inputs_it_plans_at_the_first_training_call():
    """``rematerialize(model, budget=...)`` plans nothing yet (it used to capture a call with no inputs, which fell
    back to per-layer checkpointing); the first training call plans inside itself.  A malformed budget is said at
    once.  ``inspect.signature(rm.forward)`` is the model's, which tools read to decide what to pass (transformers'
    ``Trainer`` keeps only the dataset columns a forward names)."""
    import inspect

    from remat_plugin.errors import BudgetFormatError

    a, b = _pair("gpt2-tiny")
    args, kwargs = a.make_batch(0)
    rm = rematerialize(a.module, budget=10**10, verbose=False)
    assert rm.plan is None and not rm.steps
    assert inspect.signature(rm.forward) == inspect.signature(a.module.forward)
    for module in (rm, b.module):
        torch.manual_seed(0)
        module(*args, **kwargs).loss.backward()
    assert rm.plan is not None and not rm.plan.fallback and len(rm.steps) == 1
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.module.parameters(), b.module.parameters()))
    with pytest.raises(BudgetFormatError, match="80%"):
        rematerialize(b.module, budget="eighty percent")


def test_outputs_can_be_changed_in_place_as_eager_allows():
    """``loss *= scale`` (transformers' ``Trainer`` scales the loss so) and an in-place op on the logits: eager
    allows both on a model's outputs; ours used to refuse them (views of a multi-output Function).  Gradients
    bitwise eager's."""
    a, b = _pair("gpt2-tiny")
    args, kwargs = a.make_batch(0)
    rm = rematerialize(a.module, args, kwargs, budget=10**10, verbose=False)
    for module in (rm, b.module):
        for _ in range(2):  # the second call runs the plan made for the outputs the first dropped or held
            module.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            out = module(*args, **kwargs)
            loss = out.loss
            loss *= 0.5
            out.logits.mul_(2.0)
            (loss + out.logits.float().square().mean()).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.module.parameters(), b.module.parameters()))


def test_copies_and_pickles_are_fresh_modules_that_plan_again():
    """``copy.deepcopy(rm)`` and a pickle round trip give a module over a copy of the original, with the same budget
    and options, which plans at its first training call and steps like the original (a deep copy of the planned
    state used to corrupt the heap: the process aborted at exit)."""
    import pickle

    a, b = _pair("gpt2-tiny")
    args, kwargs = a.make_batch(0)
    rm = rematerialize(a.module, args, kwargs, budget=10**10, verbose=False)
    for made in (copy.deepcopy(rm), pickle.loads(pickle.dumps(rm))):
        assert made.original is not a.module and made.budget == rm.budget and made.plan is None
        assert all(p is not q and torch.equal(p, q) for p, q in zip(made.parameters(), a.module.parameters()))
        made.original.zero_grad(set_to_none=True)
        b.module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        made(*args, **kwargs).loss.backward()
        torch.manual_seed(0)
        b.module(*args, **kwargs).loss.backward()
        assert made.plan is not None
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(made.parameters(), b.module.parameters()))


def test_new_shape_replans_and_stays_exact():
    """A new sequence length plans again; gradients still match plain PyTorch."""
    a, b = _pair("gpt2-tiny")
    args, kwargs = a.make_batch(0)
    rm = rematerialize(a.module, args, kwargs, budget=10**10)
    short = {k: v[:, :16] for k, v in kwargs.items()}
    _assert_same_step(rm, a, b, (args, short))
    assert len(rm.steps) == 2


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not capturable
            return self.lin(x).sum()
        return self.lin(-x).sum()


class _BiasTable(nn.Module):
    """A relative-position-bias-like term: a table gathered at an index the forward builds from nothing, its
    loss independent of the input (BEiT's bias, a regulariser)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(52, 4, dtype=torch.float64))
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x):
        index = torch.zeros(5, 5, dtype=torch.long)
        index[1:, 1:] = torch.arange(16).view(4, 4)
        index[0, :] = 49
        bias = self.table[index.view(-1)].square().sum()
        return bias if x is None else bias + (x * self.scale).sum()


@pytest.mark.parametrize("uses_input", [False, True])
def test_a_forward_with_nothing_from_the_input_in_a_block_plans(uses_input):
    """A block whose forward has no op (the table's, built from parameters alone) crashed the simulator."""
    model, reference = _BiasTable(), _BiasTable()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, dtype=torch.float64)
    rm = rematerialize(model, (x if uses_input else None,), budget=10**9, verbose=False)
    rm(x if uses_input else None).backward()
    reference(x if uses_input else None).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())
               if q.grad is not None)


def test_inputs_passed_outside_their_tuple_or_dict_are_named_with_the_call_to_write():
    """A tensor where the tuple of positional inputs goes failed on the tensor's truth value (or, with one element,
    was unpacked into its rows); a batch dict there was unpacked into its keys."""
    model, x = nn.Linear(4, 4), torch.randn(8, 4)
    with pytest.raises(TypeError, match=r"args is a Tensor.*rematerialize\(model, \(x,\), budget=\.\.\.\)"):
        rematerialize(model, x, budget=10**9, verbose=False)
    with pytest.raises(TypeError, match=r"args is a dict.*kwargs=batch"):
        rematerialize(model, {"input": x}, budget=10**9, verbose=False)
    with pytest.raises(TypeError, match=r"kwargs is a Tensor.*rematerialize\(model, \(x, y\), budget=\.\.\.\)"):
        rematerialize(model, (x,), x, budget=10**9, verbose=False)
    assert rematerialize(model, [x], budget=10**9, verbose=False).plan is not None  # a list is a tuple here


def test_uncapturable_model_names_the_line(capsys):
    """A model torch.export cannot capture gives a CaptureError naming the file and line, not a deep traceback,
    nor the partial graph torch.export prints to stderr (twice per failed export: thousands of lines for a
    large model, above the one line that says what failed)."""
    with pytest.raises(CaptureError, match=r"remat_plugin.capture: .*test_api.py:\d+"):
        rematerialize(_DataDependent(), (torch.randn(4, 8),), budget=10**9)
    assert "def forward" not in capsys.readouterr().err


class _ChecksItsLabels(nn.Module):
    """Reads the values of a tensor argument in Python, as transformers' CTC models do with ``labels``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is not None and labels.max() >= logits.shape[-1]:
            raise ValueError("label out of range")
        return logits if labels is None else nn.functional.cross_entropy(logits, labels)


def test_a_line_reading_an_argument_s_values_is_named_with_the_fix():
    """The error names the argument whose values the failing line reads, and the fix; without it the model plans."""
    x, labels = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    with pytest.raises(CaptureError, match=r"reads the values of 'labels'.*without labels=\.\.\."):
        rematerialize(_ChecksItsLabels(), (x,), {"labels": labels}, budget=10**9)
    assert rematerialize(_ChecksItsLabels(), (x,), budget=10**9, verbose=False).plan is not None


class _KeepsTheLabelledRows(nn.Module):
    """Branches on a size computed from a tensor argument's values, inside a block on that argument, as
    transformers' DeBERTa classification loss does (``if label_index.size(0) > 0:``)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is not None:
            labelled = (labels >= 0).nonzero()
            if labelled.size(0) > 0:
                return nn.functional.cross_entropy(logits[labelled[:, 0]], labels[labelled[:, 0]])
        return logits


def test_a_branch_on_a_size_from_an_argument_s_values_names_the_argument_with_the_fix():
    """The failing line names no argument; the block around it does, and the error names it with the fix."""
    x, labels = torch.randn(4, 8), torch.tensor([0, -1, 2, 3])
    with pytest.raises(CaptureError, match=r"the block that line is in reads the values of 'labels'.*without "
                                           r"labels=\.\.\."):
        rematerialize(_KeepsTheLabelledRows(), (x,), {"labels": labels}, budget=10**9)


def _attend(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """A library helper with its own ``attention_mask``, built from values (Pixtral's vision attention)."""
    n = sizes.sum().item()  # a size export holds unbacked
    attention_mask = torch.ones(n, n)
    if attention_mask.shape[0] > 1:  # export fails here, on a line that reads the helper's own attention_mask
        x = x * 2
    return x


class _OwnMaskInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x, attention_mask, sizes):
        return _attend(self.linear(x), sizes) * attention_mask[:, :1]


def test_a_library_s_own_local_of_an_argument_s_name_is_not_blamed():
    """The failing line reads an ``attention_mask`` of its own, not the caller's (another size): the error does not
    tell the caller to drop their ``attention_mask``."""
    x, mask, sizes = torch.randn(4, 8), torch.ones(4, 6), torch.tensor([2, 3])
    with pytest.raises(CaptureError) as refused:
        rematerialize(_OwnMaskInside(), (x,), {"attention_mask": mask, "sizes": sizes}, budget=10**9)
    assert "test_api.py" in str(refused.value) and "values of 'attention_mask'" not in str(refused.value)


def test_a_failing_torch_nn_line_is_named_with_the_fix():
    """A model that fails inside a torch.nn module gets that module's line beside its own, and BatchNorm's
    cumulative average (momentum=None, a buffer's value read every step) gets the fix."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None))
    with pytest.raises(CaptureError, match=r"inside torch/nn/modules/batchnorm\.py:\d+: .*num_batches_tracked.*"
                                           r"give it a momentum"):
        rematerialize(model, (torch.randn(4, 8),), budget=10**9)


class _CTCHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 6)

    def forward(self, x, targets):
        log_probs = self.linear(x).log_softmax(-1).transpose(0, 1)
        return nn.functional.ctc_loss(log_probs, targets, [x.shape[1]] * x.shape[0], [3] * x.shape[0])


def test_a_ctc_loss_inside_the_model_is_named_with_the_fix():
    with pytest.raises(CaptureError, match=r"CTC loss sizes its work.*compute F\.ctc_loss outside the model"):
        rematerialize(_CTCHead(), (torch.randn(2, 10, 8), torch.randint(1, 6, (2, 3))), budget=10**9)


def test_layerdrop_is_named_with_the_fix_and_plans_once_off():
    """Wav2Vec2's LayerDrop (config.layerdrop = 0.1 by default) draws whether to skip each layer at every step: the
    fallback names the setting to turn off, and with it off the model is planned."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=2, num_labels=3, mask_time_prob=0.0)
    model = transformers.Wav2Vec2ForSequenceClassification(config)
    batch = {"input_values": torch.randn(2, 800), "labels": torch.tensor([0, 2])}
    rm = rematerialize(model, (), batch, budget=10**12, verbose=False)
    assert rm.plan.fallback and "set config.layerdrop = 0.0 to plan it" in rm.plan.fallback
    model.config.layerdrop = 0.0
    assert rematerialize(model, (), batch, budget=10**12, verbose=False).plan.fallback is None


def test_parameters_swapped_for_plain_tensors_are_named_with_the_fix():
    """torch.func.functional_call with plain tensors (meta-learning, an EMA evaluated functionally): export refuses
    them; the error says why and what to call instead.  nn.Parameter values train with the original's gradients."""
    from torch.func import functional_call

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    rm = rematerialize(model, (x,), budget=10**9, verbose=False)
    tensors = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    with pytest.raises(CaptureError, match=r"swapped for plain tensors.*functional_call on the unplanned model, "
                                           r"rm\.original, or pass nn\.Parameter values"):
        functional_call(rm, tensors, (x,))
    params = {k: nn.Parameter(v.detach() * 2) for k, v in model.named_parameters()}
    grads = torch.autograd.grad(functional_call(rm, params, (x,)).sum(), list(params.values()))
    expected = torch.autograd.grad(functional_call(model, params, (x,)).sum(), list(params.values()))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


class _BranchyLayers(nn.Module):
    """Data-dependent control flow at the top, a ModuleList of BatchNorm+dropout layers inside."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Dropout(0.2)) for _ in range(4)
        )

    def forward(self, x):
        if x.mean() > 10:  # data-dependent: torch.export cannot capture this
            x = x * 2
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_uncapturable_model_with_layers_falls_back_exactly():
    """No graph, but repeated layers: per-layer checkpointing, reported in the plan, exact gradients and buffers."""
    torch.manual_seed(0)
    a = _BranchyLayers().double()
    b = copy.deepcopy(a)
    x = torch.randn(32, 16, dtype=torch.float64)
    rm = rematerialize(a, (x,), budget=10**9)
    assert rm.plan.fallback and "test_api.py" in rm.plan.fallback and "'layers'" in rm.plan.fallback
    for _ in range(2):
        for m, mod in ((a, rm), (b, b)):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(5)
            mod(x).backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad)
        for (name, ba), bb in zip(a.named_buffers(), b.buffers()):
            assert torch.equal(ba, bb), f"buffer {name} updated differently"
    assert "forward" not in a.layers[0].__dict__, "layer forwards restored after the step"


class _TowerAndLayers(nn.Module):
    """A vision tower beside a language model, as a VLM holds them, with a data-dependent branch: the tower's
    wide activations are the step's memory, the language layers its parameters."""

    def __init__(self):
        super().__init__()
        block = lambda width: nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, 64))
        self.tower = nn.ModuleList(block(512) for _ in range(4))
        self.layers = nn.ModuleList(block(1024) for _ in range(4))

    def forward(self, image, text):
        if image.mean() > 10:  # data-dependent: torch.export cannot capture this
            image = image * 2
        for block in self.tower:
            image = image + block(image)
        text = text + image.mean(0)
        for layer in self.layers:
            text = text + layer(text)
        return text.square().mean()


def test_the_fallback_meters_how_many_layers_it_checkpoints():
    """NOTE [metered fallback]: with room, no layer is checkpointed (nothing recomputed for nothing); below what
    every layer checkpointed measures, the call is refused before it runs, naming that; between, the measured
    step stays within its budget.  Both lists are checkpointed, the tower's too, not only the one holding the
    most parameters (its 512-wide activations are most of the step's memory); gradients are eager's."""
    from remat_plugin.capture.memory_meter import measure_peak_profiler

    torch.manual_seed(0)
    model = _TowerAndLayers().double()
    ref = copy.deepcopy(model)
    image, text = torch.randn(256, 64, dtype=torch.float64), torch.randn(8, 64, dtype=torch.float64)

    def measured(m) -> int:
        m(image, text).backward()  # the first step: not measured
        m.zero_grad(set_to_none=True)
        return measure_peak_profiler(lambda: m(image, text).backward())[1]

    eager = measured(ref)
    rm = rematerialize(model, (image, text), budget=10**9, verbose=False)
    assert "'layers' and 'tower'" in rm.plan.fallback and "(8 layers)" in rm.plan.fallback
    assert measured(rm) == eager and all(b.mode == "keep" for b in rm.plan.blocks)
    assert rm.plan.baseline_peak_bytes == rm.plan.predicted_peak_bytes == eager
    model.zero_grad(set_to_none=True)
    with pytest.raises(InfeasibleBudgetError, match=r"each of its 8 layers checkpointed") as refused:
        rematerialize(model, (image, text), budget=2**20, verbose=False)(image, text)
    assert all(p.grad is None for p in model.parameters()), "refused before the step ran"
    floor = refused.value.min_feasible_bytes
    assert floor < eager - 3 * 2**20, (floor, eager)  # 9.0 against 13.8 MiB: the tower's activations are gone
    for budget in (floor, (floor + eager) // 2):
        rm = rematerialize(model, (image, text), budget=budget, verbose=False)
        peak = measured(rm)
        assert peak <= budget and abs(peak - rm.plan.predicted_peak_bytes) <= 2**16, (budget, peak, rm.plan)
        checkpointed = sum(b.mode == "checkpoint" for b in rm.plan.blocks)
        assert 0 < checkpointed <= 8, rm.plan.blocks
        ref.zero_grad(set_to_none=True)
        ref(image, text).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


def test_the_fallback_is_metered_under_autocast_as_the_caller_s_step_runs():
    """Under bf16 autocast the caller's step casts the weights afresh, after the metered steps (NOTE [metered
    fallback]): its measured peak is at most the metered one, within the budget.  Metering in one autocast cache
    counted the casts in the first metered step only, so the chosen step measured above its prediction."""
    from remat_plugin.capture.memory_meter import measure_peak_profiler

    torch.manual_seed(0)
    model = _TowerAndLayers()
    image, text = torch.randn(256, 64), torch.randn(8, 64)

    def step(m) -> None:
        with torch.autocast("cpu", torch.bfloat16):
            loss = m(image, text)
        loss.backward()

    with pytest.raises(InfeasibleBudgetError) as refused:
        step(rematerialize(model, (image, text), budget=2**20, verbose=False))
    rm = rematerialize(model, (image, text), budget=refused.value.min_feasible_bytes + 2**19, verbose=False)
    step(rm)  # metered, then run
    model.zero_grad(set_to_none=True)
    peak = measure_peak_profiler(lambda: step(rm))[1]
    assert any(b.mode == "checkpoint" for b in rm.plan.blocks)
    assert peak <= rm.plan.predicted_peak_bytes <= rm.plan.budget_bytes, (peak, rm.plan)


class _TowerWithLogits(_TowerAndLayers):
    """Also returns 4 MiB of logits beside the loss, as a language model's output does."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 2048)

    def forward(self, image, text):
        if image.mean() > 10:
            image = image * 2
        for block in self.tower:
            image = image + block(image)
        logits = self.head(image)
        return nn.functional.log_softmax(logits, -1).mean() + super().forward(image, text), logits


def test_the_fallback_is_metered_again_for_the_outputs_its_caller_frees_or_holds(caplog):
    """NOTE [metered fallback]: metered holding every output, then, once the loop shows it keeps only the loss,
    again with the logits freed (4 MiB lower unmodified: 2 layers checkpointed instead of 5); a step holding them
    afterwards is warned about and the step metered again with them held, for good.  Gradients are eager's
    throughout."""
    from remat_plugin.capture.memory_meter import measure_peak_profiler

    torch.manual_seed(0)
    model = _TowerWithLogits().double()
    ref = copy.deepcopy(model)
    image, text = torch.randn(256, 64, dtype=torch.float64), torch.randn(8, 64, dtype=torch.float64)
    budget = 24 * 2**20  # unmodified 31 MiB holding the logits
    rm = rematerialize(model, (image, text), budget=budget, verbose=False)
    metered = []
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        for hold in (False, False, False, True, False, False):
            for m in (rm, ref):
                m.zero_grad(set_to_none=True)
                out = m(image, text)
                loss, _held = out if hold else (out[0], None)  # the logits alive through backward, or not
                del out
                loss.backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
            metered.append((rm.plan.dropped_outputs, rm.plan.baseline_peak_bytes,
                            sum(b.mode == "checkpoint" for b in rm.plan.blocks)))
    assert metered[0][0] == () and metered[1][0] == (1,), metered
    assert metered[1][1] <= metered[0][1] - 4 * 2**20 + 2**16 and metered[1][2] < metered[0][2], metered
    assert metered[4] == metered[5] == metered[0], metered  # held at step 3: metered again with them held
    assert caplog.text.count("held output(s) [1] (4.00 MiB) through backward, which its metering had freed") == 1
    model.zero_grad(set_to_none=True)
    assert measure_peak_profiler(lambda: rm(image, text)[0].backward())[1] <= budget


class _TowerSelectingByMask(_TowerAndLayers):
    """Exported, but its boolean-mask selection fails at the trace: the fallback is made inside the first call."""

    def forward(self, image, text):
        for block in self.tower:
            image = image + block(image)
        text = text + image[image[:, 0] > 0].mean(0)
        for layer in self.layers:
            text = text + layer(text)
        return text.square().mean()


def test_a_fallback_made_inside_the_first_call_is_metered_before_it_runs():
    """Planned lazily (no example inputs), the graph fails at the trace inside the first call: that call is
    metered before it runs the fallback, so a budget below every layer checkpointed is refused before anything
    ran, and a roomy one recomputes nothing even at the first call (it checkpointed every layer, unverified)."""
    torch.manual_seed(0)
    model = _TowerSelectingByMask().double()
    image, text = torch.randn(256, 64, dtype=torch.float64), torch.randn(8, 64, dtype=torch.float64)
    with pytest.raises(InfeasibleBudgetError, match=r"each of its 8 layers checkpointed"):
        rematerialize(model, budget=2**20, verbose=False)(image, text)
    assert all(p.grad is None for p in model.parameters())
    rm = rematerialize(model, budget=10**9, verbose=False)
    rm(image, text).backward()
    assert "could not be traced" in rm.plan.fallback and all(b.mode == "keep" for b in rm.plan.blocks)
    assert rm.plan.predicted_peak_bytes == rm.plan.baseline_peak_bytes > 0


class _JacobianPenalty(ResidualLayers):
    """Its forward takes the input Jacobian of its layers with torch.func (a contractive penalty): no graph, and
    torch.func refuses the saved-tensor hooks of checkpointing."""

    def __init__(self):
        super().__init__(8, 32)

    def forward(self, x):
        jacobian = torch.func.vmap(torch.func.jacrev(lambda v: self.residual(v).sum(-1, keepdim=True)))(x)
        return self.residual(x).square().mean() + jacobian.square().mean()


def test_a_fallback_whose_layers_run_under_torch_func_runs_them_unmodified_or_refuses_the_budget():
    """NOTE [metered fallback]: the layers cannot be checkpointed under torch.func (its step raised torch.func's
    "don't yet support saved tensor hooks" out of the caller's step); metered unmodified, the step trains
    bitwise eager's within a roomy budget and is refused before it runs below its peak."""
    torch.manual_seed(0)
    model = _JacobianPenalty().double()
    reference = copy.deepcopy(model)
    x = torch.randn(64, 8, dtype=torch.float64)
    with pytest.raises(InfeasibleBudgetError, match=r"none of whose 3 layers can be recomputed .*torch.func"):
        rematerialize(model, (x,), budget=2**16, verbose=False)(x)
    assert all(p.grad is None for p in model.parameters())
    rm = rematerialize(model, (x,), budget=10**9, verbose=False)
    for m in (rm, reference):
        for _ in range(2):
            m(x).backward()
    assert all(b.mode == "keep" for b in rm.plan.blocks) and rm.plan.predicted_peak_bytes > 0
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


class _SelectsByMask(nn.Module):
    """Boolean-mask selection (``h[mask]``): torch.export holds its size unbacked, AOTAutograd's trace at fixed sizes
    cannot (NOTE [untraceable graphs])."""

    def __init__(self, n_layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(n_layers))

    def forward(self, x, mask):
        for layer in self.layers:
            h = torch.tanh(layer(x))
            x = x + h + h[mask].sum()
        return x.square().mean()


@pytest.mark.parametrize("lazily", [False, True])
def test_a_graph_the_trace_cannot_hold_falls_back_or_raises_naming_the_line(lazily):
    x = torch.randn(32, 16, dtype=torch.float64)
    mask = torch.arange(32) % 3 == 0
    model = _SelectsByMask(4).double()
    ref = copy.deepcopy(model)
    rm = rematerialize(model, budget=10**9, verbose=False) if lazily else \
        rematerialize(model, (x, mask), budget=10**9, verbose=False)
    for _ in range(2):
        for m in (rm, ref):
            m(x, mask).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert rm.plan is not None and rm.plan.fallback
    assert "could not be traced" in rm.plan.fallback and "boolean mask" in rm.plan.fallback
    assert "test_api.py" in rm.plan.fallback  # the model's line
    single = _SelectsByMask(1).double()  # one layer: no list of repeated layers to fall back on
    with pytest.raises(CaptureError, match=r"could not be traced.*nonzero.*no list of repeated layers"):
        rm = rematerialize(single, budget=10**9, verbose=False) if lazily else \
            rematerialize(single, (x, mask), budget=10**9, verbose=False)
        rm(x, mask).backward()


class _NoisyByIndex(nn.Module):
    """Adds integer noise made like an activation (``torch.randint_like(h, 0, 3)``): eager's result takes no
    gradient, AOTAutograd's trace looks for one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return (h + torch.randint_like(h, 0, 3)).square().mean()


def test_random_op_made_like_a_graded_tensor_is_refused_naming_the_fix():
    with pytest.raises(CaptureError, match=r"randint_like of a tensor that requires grad.*\.detach\(\)"):
        rematerialize(_NoisyByIndex(), (torch.randn(4, 16),), budget=10**9, verbose=False)


def test_smaller_shapes_replay_a_covering_plan_larger_ones_plan_anew():
    """RematModule resolves steps like the session: a smaller batch replays the plan (no solve), a larger one plans."""
    from remat_plugin.bench.models import mlp_chain

    bench, ref = (mlp_chain(n_blocks=4, width=64, batch_size=256, dtype=torch.float64) for _ in range(2))
    (x, y), _ = bench.make_batch(0)
    _, plain_peak = measure_peak(lambda: ref.module(x, y).backward())
    ref.module.zero_grad()
    rm = rematerialize(bench.module, (x, y), budget=int(plain_peak * 0.7))
    solved = rm.plan
    assert solved is not None and solved.planning_s > 0 and rm.problem is not None
    stages = dict(solved.planning_stages)  # where the time went, for the summary and the planning benchmark
    assert list(stages) == ["export", "trace", "profile", "block menus", "budget search"]
    assert all(s >= 0 for s in stages.values()) and stages["profile"] + stages["block menus"] <= solved.planning_s
    torch.manual_seed(1)
    rm(x[:100], y[:100]).backward()
    torch.manual_seed(1)
    ref.module(x[:100], y[:100]).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(bench.module.parameters(), ref.module.parameters()))
    assert rm.plan.schedule == solved.schedule and rm.plan.planning_s == 0.0 and rm.problem is None  # replayed
    assert rm.plan.planning_stages == ()
    assert rm.plan.predicted_peak_bytes < solved.predicted_peak_bytes  # re-simulated at the smaller sizes
    big = (torch.cat([x, x[:44]]), torch.cat([y, y[:44]]))
    rm(*big).backward()
    assert len(rm.steps) == 3 and rm.plan.planning_s > 0 and rm.problem is not None  # a new plan for 300 rows
