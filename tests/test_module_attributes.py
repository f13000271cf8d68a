"""Python values the modules hold are constants of a planned step (NOTE [module attributes]): changing one after
planning captures again (it used to change nothing, silently); a value the forward itself writes, or does not
read, stops being watched."""
import argparse
import copy
import dataclasses
import functools
import logging
import sys
import types
import weakref

import guard_helpers as _helpers_file  # the user's ``helpers.py``
import pytest
import torch
from budgets import planned_beside_eager
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture.export import _constant_text
from remat_plugin.capture.module_attributes import Guard, snapshot


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.1)) for _ in range(3))
        self.temperature = 1.0
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a Python side effect: runs while traced only
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return (x / self.temperature).square().mean()


X = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _step(rm, ref, label: str, x: torch.Tensor = X) -> None:
    for m in (rm, ref):
        torch.manual_seed(0)
        m(x).backward()
    model = rm.original
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())), label
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers())), label
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


def _change_each(rm, ref, changes, caplog, x: torch.Tensor = X) -> None:
    """Make each change to both models, then a step: bitwise, and the change named in a warning."""
    for name, change in changes:
        caplog.clear()
        for m in (rm.original, ref):
            change(m)
        with caplog.at_level(logging.WARNING, logger="remat_plugin"):
            _step(rm, ref, name, x)
        assert f"{type(ref).__name__}'s {name} (" in caplog.text and "changed since its step was traced" in caplog.text


def test_values_changed_after_planning_take_effect(caplog):
    model = Tempered().double()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, budget=10**9, verbose=False)
        for i in range(3):
            _step(rm, ref, f"step {i}")
    assert "forward changes Python values (calls)" in caplog.text
    assert "changed since its step was traced" not in caplog.text  # the counter is not watched
    changes = [
        ("temperature", lambda m: setattr(m, "temperature", 0.5)),
        ("layers.1.2.p", lambda m: setattr(m.layers[1][2], "p", 0.5)),  # a dropout's probability
        ("layers.0.1.training", lambda m: m.layers[0][1].eval()),  # a BatchNorm frozen
        ("layers.2.1.momentum", lambda m: setattr(m.layers[2][1], "momentum", 0.5)),
    ]
    _change_each(rm, ref, changes, caplog)


def test_a_value_the_forward_does_not_read_is_captured_again_once():
    model = Tempered().double()
    model.step = 0
    ref = copy.deepcopy(model)
    rm = rematerialize(model, budget=10**9, verbose=False)
    _step(rm, ref, "first")
    replayed = rm._resolver.n_replayed
    for i in range(1, 5):  # a training loop keeping its step count on the model
        model.step = ref.step = i
        _step(rm, ref, f"step {i}")
    assert rm._resolver.n_replayed == replayed + 1  # captured again once: the same graph, so no longer watched
    assert rm._resolver.n_solved == 1


def test_a_step_count_kept_on_a_model_with_layers_traced_once_is_captured_again_once():
    """Each capture of a layered model names its layer calls anew, so the graphs never compared equal and a value
    the forward does not read was captured again at every step (found 2026-11-29; ``graph_text``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).double().train()
    ids = torch.randint(0, 64, (2, 16))
    rm = rematerialize(model, (), {"input_ids": ids, "labels": ids}, budget=10**10, verbose=False)
    assert rm.plan is not None and not rm.plan.fallback
    made = []
    for step in range(5):
        model.step = step  # a training loop keeping its step count on the model
        rm(input_ids=ids, labels=ids).loss.backward()
        made.append(rm._resolver.n_solved + rm._resolver.n_replayed + rm._resolver.n_refined)
    assert made[-1] == made[1], made  # captured again once (the count's first change), then no longer watched


def test_a_transformers_config_value_changed_after_planning_takes_effect():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).double().train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    rm = rematerialize(model, budget=10**9, verbose=False)
    assert rm(input_ids=ids, labels=ids).hidden_states is None
    model.config.output_hidden_states = True
    out = rm(input_ids=ids, labels=ids)
    assert out.hidden_states is not None and len(out.hidden_states) == 3



def test_a_value_the_forward_sets_once_is_set_and_watched(caplog):
    """transformers' classification heads set ``config.problem_type`` from the labels at their first call (NOTE
    [values set once]): after a planned step it is set as after an eager one, unwarned, and the caller's later
    change of it (another loss) takes effect."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     vocab_size=64, num_labels=3)
    model = transformers.BertForSequenceClassification(config).double().train()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (4, 16), generator=gen)
    targets = torch.nn.functional.one_hot(torch.randint(0, 3, (4,), generator=gen), 3).double()

    def step(label: str) -> None:
        for m in (rm, ref):
            torch.manual_seed(0)
            m(input_ids=ids, labels=targets).loss.backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())), label
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)

    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, budget=10**9, verbose=False)
        step("first")
        step("second")
    assert "forward changes Python values" not in caplog.text
    assert model.config.problem_type == ref.config.problem_type == "multi_label_classification"
    caplog.clear()
    for m in (model, ref):
        m.config.problem_type = "regression"  # the same inputs, another loss
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        step("regression")
    assert "config.problem_type ('regression', traced with 'multi_label_classification')" in caplog.text

class _Windowed(nn.Module):
    """Clamps its window to a shorter input at every call, as transformers' Swin layers clamp ``shift_size`` and
    ``window_size`` (NOTE [values the forward sets])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.window, self.shift = 8, 3

    def forward(self, x):
        if x.shape[1] <= self.window:
            self.shift, self.window = 0, x.shape[1]
        h = self.drop(self.lin(x))
        return (torch.roll(h, self.shift, dims=1) if self.shift else h).tanh().square().mean()


def test_a_value_the_forward_sets_from_its_inputs_sizes_is_not_taken_for_a_counter(caplog):
    """The first call clamps the values, later calls write what is there: nothing is warned about, the model is
    left as an eager call leaves it, and steps are bitwise; a longer input is unclamped and also bitwise."""
    model = _Windowed().double()
    ref = copy.deepcopy(model)
    short = torch.randn(4, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, budget=10**9, verbose=False)
        for i in range(3):
            _step(rm, ref, f"step {i}", short)
    assert "forward changes Python values" not in caplog.text
    assert (model.shift, model.window) == (ref.shift, ref.window) == (0, 6)
    fresh, fresh_ref = _Windowed().double(), _Windowed().double()
    long = torch.randn(4, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rm = rematerialize(fresh, budget=10**9, verbose=False)
    for i in range(2):
        _step(rm, fresh_ref, f"long step {i}", long)
    assert (fresh.shift, fresh.window) == (3, 8)


class _InitialisedOnce(nn.Module):
    """Takes a branch at its first call only, flagged by a Python bool (an ActNorm set from the first batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.initialised = False

    def forward(self, x):
        h = self.lin(x)
        if not self.initialised:
            self.initialised = True
            h = h - h.mean(0)
        return h.tanh().square().mean()


def test_a_branch_taken_at_the_first_call_only_is_not_taken_for_a_size_clamp(caplog):
    """The second trace writes nothing but exports another graph: the values are put back, and the flag is warned
    about as a value the forward changes, as before (NOTE [values the forward sets])."""
    model = _InitialisedOnce().double()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, budget=10**9, verbose=False)
        rm(X).backward()
    assert "forward changes Python values (initialised)" in caplog.text
    assert model.initialised is False


class Scaled(nn.Module):
    """A plain tensor attribute (not a registered buffer), and an activation module without parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.scale = torch.full((16,), 2.0, dtype=torch.float64)
        self.act = nn.GELU()

    def forward(self, x):
        for layer in self.layers:
            x = x + self.act(layer(x)) * self.scale
        return x.square().mean()


def test_tensor_attributes_and_replaced_submodules(caplog):
    model = Scaled().double()
    ref = copy.deepcopy(model)
    ref.scale = model.scale.clone()
    rm = rematerialize(model, budget=10**9, verbose=False)
    _step(rm, ref, "first")
    assert rm.plan is not None and not rm.plan.fallback  # it used to fall back: the constant met fake tensors
    for m in (model, ref):
        m.scale.fill_(3.0)  # in place: the step reads the very tensor
    _step(rm, ref, "in place")
    changes = [("scale", lambda m: setattr(m, "scale", torch.full((16,), 0.5, dtype=torch.float64))),
               ("act", lambda m: setattr(m, "act", nn.Tanh()))]
    _change_each(rm, ref, changes, caplog)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout, self.temperature = nn.Linear(32, 32), nn.Dropout(0.1), 1.0

    def forward(self, x):
        return x + self.dropout(torch.tanh(self.linear(x))) / self.temperature


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


class _SharedBlocks(nn.Module):
    """One block applied three times (ALBERT-style): torch.export traces a copy of such a model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_Block()] * 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_shared_submodule_is_not_taken_for_one_the_forward_replaced(caplog):
    """NOTE [shared submodules]: the traced copy's submodules are other objects; that is no value the forward
    wrote (it used to warn so, and leave the submodules unwatched), and a change made after planning is seen."""
    model = _SharedBlocks().double()
    ref = copy.deepcopy(model)
    x = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, budget=10**9, verbose=False)
        for i in range(2):
            _step(rm, ref, f"step {i}", x)
    assert "forward changes Python values" not in caplog.text
    changes = [("layers.0.dropout.p", lambda m: setattr(m.layers[0].dropout, "p", 0.5)),
               ("layers.0.dropout", lambda m: setattr(m.layers[0], "dropout", nn.Dropout(0.2)))]
    _change_each(rm, ref, changes, caplog, x)


def test_fsdp2_units_build_their_step_again_for_a_changed_value(caplog):
    """One process over gloo: each leaf ``fully_shard`` unit's step is guarded as a whole model's is."""
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from remat_plugin import rematerialize_fsdp

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = _Blocks().double()
        ref = copy.deepcopy(model)
        for m in (model, ref):
            for layer in m.layers:
                fully_shard(layer)
            fully_shard(m)
        rematerialize_fsdp(model, budget=10**9)
        x = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

        def step(label: str) -> None:
            for m in (model, ref):
                torch.manual_seed(0)
                m(x).backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), label
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)

        step("first")
        step("second")
        for name, change in (("unit.temperature", lambda m: setattr(m.layers[1], "temperature", 0.5)),
                             ("unit.dropout.p", lambda m: setattr(m.layers[2].dropout, "p", 0.5))):
            caplog.clear()
            for m in (model, ref):
                change(m)
            with caplog.at_level(logging.WARNING, logger="remat_plugin"):
                step(name)
            assert f"{name} (" in caplog.text and "changed since its step was traced" in caplog.text
    finally:
        dist.destroy_process_group()


class _ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.scale = nn.Linear(16, 16), torch.full((16,), 2.0, dtype=torch.float64)

    def forward(self, x):
        return x + torch.tanh(self.linear(x)) * self.scale


def test_tensor_attributes_inside_repeated_layers_plan():
    """Layers holding plain tensors are traced whole, so their tensors are inputs too (they fell back)."""
    model = _Blocks().double()
    model.layers = nn.ModuleList(_ScaledBlock() for _ in range(3)).double()
    ref = copy.deepcopy(model)
    rm = rematerialize(model, budget=10**9, verbose=False)
    for i in range(2):
        _step(rm, ref, f"step {i}")
    assert rm.plan is not None and not rm.plan.fallback


class _ToggledAuxiliary(nn.Module):
    """Residual layers (which a layered trace does not splice: each is traced whole) and a flag a curriculum
    toggles between steps."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)) for _ in range(3))
        self.use_aux = True

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean() + (x.abs().mean() if self.use_aux else 0)


def test_a_value_toggled_back_takes_effect_in_a_model_traced_whole():
    """The step re-planned after the first change exported the model again, whole, and lost its guard: toggling
    back ran the other branch's step (found 2026-11-29)."""
    torch.manual_seed(0)
    model = _ToggledAuxiliary().double()
    planned, reference = planned_beside_eager(model, (torch.randn(32, 16, dtype=torch.float64),))
    x = torch.randn(32, 16, dtype=torch.float64)
    for use_aux in (True, False, False, True, False):
        model.use_aux = reference.use_aux = use_aux
        for m, module in ((planned, model), (reference, reference)):
            module.zero_grad(set_to_none=True)
            m(x).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())), use_aux


class _ClassScaled(nn.Module):
    """Reads a value its class holds (as transformers' attention classes hold ``is_causal``) and a default."""

    scale = 1.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) * self.scale * getattr(self, "extra", 1.0)).square().mean()


def test_a_value_set_on_the_module_over_its_class_s_takes_effect(caplog):
    """Setting ``model.scale`` adds a name to the module's ``__dict__``, which the guard did not watch: the planned
    step kept the class's value (NOTE [values set on the module], found 2026-11-29)."""
    torch.manual_seed(0)
    model = _ClassScaled().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    for attr, value in (("scale", 1.0), ("scale", 3.0), ("extra", 0.5), ("scale", 1.0)):
        setattr(model, attr, value)
        setattr(reference, attr, value)
        with caplog.at_level(logging.WARNING, logger="remat_plugin"):
            assert torch.equal(planned(x), reference(x)), (attr, value)
    assert "scale (3.0, traced with no value of the module's own" in caplog.text, caplog.text
    assert planned._resolver.n_solved + planned._resolver.n_replayed == 4, "1.0 over the class's 1.0 changes nothing"


TEMPERATURE = 1.0  # a schedule the training script changes between steps (NOTE [globals the forward reads])
SETTINGS = argparse.Namespace(noise_scale=0.0, label="x")


def _tempered(x):
    return x / TEMPERATURE


class _ReadsGlobals(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @torch.autocast("cpu", enabled=False)  # a decorated forward: the names its own code loads are read
    def forward(self, x):
        return (_tempered(self.lin(x)) + self._noise(x)).square().mean()

    def _noise(self, x):
        return SETTINGS.noise_scale * x


def test_globals_and_a_settings_object_the_forward_reads_are_watched(caplog):
    """A global read through a helper of the forward's file, and a field of an ``argparse.Namespace`` global read
    in a method, changed between steps: the planned step held the traced values (found 2026-11-29)."""
    global TEMPERATURE
    torch.manual_seed(0)
    model = _ReadsGlobals().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    try:
        for temperature, noise_scale in ((1.0, 0.0), (2.0, 0.0), (2.0, 0.5), (1.0, 0.5)):
            TEMPERATURE, SETTINGS.noise_scale = temperature, noise_scale
            with caplog.at_level(logging.WARNING, logger="remat_plugin"):
                assert torch.equal(planned(x), reference(x)), (temperature, noise_scale)
    finally:
        TEMPERATURE, SETTINGS.noise_scale = 1.0, 0.0
    assert "TEMPERATURE (a global of test_module_attributes) (2.0, traced with 1.0)" in caplog.text, caplog.text
    assert "SETTINGS.noise_scale (a global of test_module_attributes)" in caplog.text


@dataclasses.dataclass
class _BlockSettings:
    scale: float = 1.0
    gated: bool = False


class _ReadsItsSettings(nn.Module):
    def __init__(self, cfg: _BlockSettings):
        super().__init__()
        self.cfg = cfg
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x) * self.cfg.scale
        return (torch.sigmoid(h) * h if self.cfg.gated else h).square().mean()


def test_a_settings_object_a_module_holds_is_watched():
    """``self.cfg.scale`` of a dataclass the module holds, changed after planning (NOTE [settings a module holds])."""
    torch.manual_seed(0)
    model = _ReadsItsSettings(_BlockSettings()).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    for scale, gated in ((1.0, False), (2.0, False), (2.0, True), (1.0, False)):
        for m in (model, reference):
            m.cfg.scale, m.cfg.gated = scale, gated
        assert torch.equal(planned(x), reference(x)), (scale, gated)


class _ReadsContainers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scales = [1.0, 2.0]
        self.opts = {"scale": 1.0, "dims": (0,)}

    def forward(self, x):
        return (self.lin(x) * self.scales[0] * self.opts["scale"]).square().mean(dim=self.opts["dims"]).sum()


def test_lists_and_dicts_of_values_changed_in_place_or_replaced_take_effect():
    """NOTE [containers of values] (found 2026-11-29: each was a silent constant)."""
    torch.manual_seed(0)
    model = _ReadsContainers().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    changes = [lambda m: m.scales.__setitem__(0, 3.0), lambda m: setattr(m, "scales", [0.5, 1.0]),
               lambda m: m.opts.__setitem__("scale", 2.0), lambda m: m.opts.__setitem__("dims", (1,))]
    for i, change in enumerate(changes):
        change(model)
        change(reference)
        assert torch.equal(planned(x), reference(x)), i


class _Tanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _TwoTanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Tanh(), _Tanh()

    def forward(self, x):
        return self.b(self.a(x)).square().mean()


def _sigmoid_forward(self, x):
    return torch.sigmoid(self.lin(x))


def test_a_forward_patched_after_planning_takes_effect():
    """NOTE [forward replaced]: a module's forward replaced on the module, then on its class, then wrapped by a
    logger that traces to the same graph (captured again once, then no longer watched)."""
    torch.manual_seed(0)
    model = _TwoTanh().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    for m in (model, reference):
        m.a.forward = types.MethodType(_sigmoid_forward, m.a)
    assert torch.equal(planned(x), reference(x))
    original = _Tanh.forward
    try:
        _Tanh.forward = lambda self, x: torch.relu(self.lin(x))
        assert torch.equal(planned(x), reference(x))
        calls = []
        for m in (model, reference):
            inner = m.b.forward
            m.b.forward = lambda x, inner=inner: calls.append(1) or inner(x)
        captures = planned._resolver.n_solved + planned._resolver.n_replayed
        for _ in range(3):
            assert torch.equal(planned(x), reference(x))
        assert planned._resolver.n_solved + planned._resolver.n_replayed == captures + 1
    finally:
        _Tanh.forward = original


def _lightning_module_reading_its_hparams() -> nn.Module:
    import lightning as L

    class ReadsHparams(L.LightningModule):
        def __init__(self, scale: float = 1.0, gated: bool = False):
            super().__init__()
            self.save_hyperparameters()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x) * self.hparams.scale
            return (torch.sigmoid(h) * h if self.hparams.gated else h).square().mean()
    return ReadsHparams()


class _ReadsOmegaConf(nn.Module):
    def __init__(self):
        super().__init__()
        from omegaconf import OmegaConf
        self.cfg = OmegaConf.create({"model": {"scale": 1.0, "dims": [0]}, "gated": False})
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x) * self.cfg.model.scale
        return (torch.sigmoid(h) * h if self.cfg.gated else h).square().mean(dim=tuple(self.cfg.model.dims)).sum()


@pytest.mark.parametrize("kind", ["lightning hparams", "omegaconf"])
def test_lightning_hparams_and_an_omegaconf_config_the_forward_reads_are_watched(kind):
    """``self.hparams.scale`` (an ``AttributeDict`` held as ``_hparams``) and ``self.cfg.model.scale`` of a
    ``DictConfig``, changed after planning: silent constants before (found 2026-11-29; NOTE [settings a module
    holds])."""
    torch.manual_seed(0)
    model = (_lightning_module_reading_its_hparams() if kind == "lightning hparams" else _ReadsOmegaConf()).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    for scale, gated in ((1.0, False), (2.0, False), (2.0, True), (1.0, False), (2.0, False)):
        for m in (model, reference):
            if kind == "lightning hparams":
                m.hparams.scale, m.hparams.gated = scale, gated
            else:
                m.cfg.model.scale, m.cfg.gated = scale, gated
        assert torch.equal(planned(x), reference(x)), (scale, gated)
    if kind == "omegaconf":  # a nested list changed in place
        for m in (model, reference):
            m.cfg.model.dims[0] = 1
        assert torch.equal(planned(x), reference(x))


_settings_file = types.ModuleType("remat_test_settings_file")  # stands for ``import config as C`` of the user's
_settings_file.SCALE = 1.0
sys.modules[_settings_file.__name__] = _settings_file


class _ReadsASettingsFile(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) * _settings_file.SCALE).square().mean()


def test_a_value_of_a_settings_file_the_forward_reads_is_watched(caplog):
    """``C.SCALE`` of another Python file, changed between steps (NOTE [a settings file's values]): a silent
    constant before (found 2026-11-29)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(_ReadsASettingsFile().double(), (x,))
    try:
        for scale in (1.0, 2.0, 1.0, 3.0):
            _settings_file.SCALE = scale
            with caplog.at_level(logging.WARNING, logger="remat_plugin"):
                assert torch.equal(planned(x), reference(x)), scale
    finally:
        _settings_file.SCALE = 1.0
    assert "SCALE (a global of remat_test_settings_file) (2.0, traced with 1.0)" in caplog.text, caplog.text


class _MakesConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        # a tensor in the default dtype, and one made from a value the module holds
        return (self.lin(x) * torch.tensor(self.scale, dtype=x.dtype) + torch.tensor(1 / 3)).square().mean()


def test_the_default_dtype_and_a_value_read_through_a_tensor_made_of_it_are_watched():
    """NOTE [default dtype]: ``torch.set_default_dtype`` after planning failed inside the graph ("Tensor dtype
    mismatch").  A value read only through ``torch.tensor(self.scale)`` was found not read at its first change (the
    graph's code the same, the constant's contents not compared), so changing it back went unseen (found
    2026-11-29, :func:`remat_plugin.capture.export.graph_text`)."""
    torch.manual_seed(0)
    model = _MakesConstants().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    try:
        for dtype, scale in ((torch.float32, 1.0), (torch.float64, 1.0), (torch.float32, 1.0), (torch.float64, 1.0),
                             (torch.float32, 2.0), (torch.float32, 1.0), (torch.float32, 2.0)):
            torch.set_default_dtype(dtype)
            model.scale = reference.scale = scale
            assert torch.equal(planned(x), reference(x)), (dtype, scale)
    finally:
        torch.set_default_dtype(torch.float32)



def test_a_constant_whose_bytes_cannot_be_read_is_never_taken_for_the_same():
    """``graph_text`` digests a forward-made constant's bytes; a sparse one raised there ("reshape is not implemented
    for sparse tensors") and one whose bytes cannot be read (a meta tensor here) too.  Sparse ones are digested dense;
    unreadable ones compare unequal, so a value read through one stays watched."""
    sparse = torch.eye(3).to_sparse()
    assert _constant_text("c", sparse, held=False) == _constant_text("c", torch.eye(3).to_sparse(), held=False)
    assert _constant_text("c", sparse, held=False) != _constant_text("c", (2 * torch.eye(3)).to_sparse(), held=False)
    unreadable = torch.empty(3, device="meta")
    assert _constant_text("c", unreadable, held=False) != _constant_text("c", unreadable, held=False)
    assert "held by the model" in _constant_text("c", unreadable, held=True)


def test_the_guard_s_walk_by_identity_sees_what_reading_each_value_sees():
    """NOTE [the guard's walk]: values compared by identity per owner, an equal value set again (another object)
    taken as unchanged and held from then on, and every change after it, a deletion and a changed container seen."""
    m = nn.Linear(2, 2)
    m.scale, m.sizes, m.name, m.scales = 1.5, (3, 3), "a", [1.0, 2.0]
    guard = Guard(weakref.ref(m), tuple(snapshot(m)))
    assert guard.changed() == []
    m.scale, m.sizes = float("1.5"), tuple(x for x in (3, 3))  # equal, other objects
    assert guard.changed() == [] and guard.changed() == []
    m.scale = 2.0
    assert [(where, now) for where, now, _ in guard.changed()] == [("scale", 2.0)]
    m.scale = 1.5
    assert guard.changed() == []
    m.sizes = (3, 4)
    assert [where for where, _, _ in guard.changed()] == ["sizes"]
    m.sizes = (3, 3)
    m.scales[1] = 3.0  # in place
    assert [where for where, _, _ in guard.changed()] == ["scales"]
    m.scales[1] = 2.0
    del m.name
    assert [where for where, _, _ in guard.changed()] == ["name"]
    m.name = "a"
    m.training = False
    assert [where for where, _, _ in guard.changed()] == ["training"]

class _HoldsAGain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = torch.ones(8, dtype=torch.float64)  # a plain tensor attribute, changed in place by the loop
        self.steps = 0

    def forward(self, x):
        return (self.lin(x) * self.gain).square().mean()


def test_a_tensor_the_model_holds_changed_in_place_does_not_capture_at_every_step():
    """Its contents are the caller's to change (NOTE [tensor attributes]): the graph comparison that finds the step
    counter not read takes its dtype and shape only, or the model captured again at every step."""
    model = _HoldsAGain().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    made = []
    for step in range(1, 5):
        model.steps = reference.steps = step
        with torch.no_grad():
            model.gain.mul_(1.1)
            reference.gain.mul_(1.1)
        assert torch.equal(planned(x), reference(x)), step
        made.append(planned._resolver.n_solved + planned._resolver.n_replayed + planned._resolver.n_refined)
    assert made == [2, 2, 2, 2], made


class _Schedule:
    def __init__(self):
        self.epoch = 0


_SCHEDULE = _Schedule()  # an object of the script's, no settings object: read only through the property


class _ReadsAProperty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @property
    def warming_up(self) -> bool:
        return _SCHEDULE.epoch < 1

    def forward(self, x):
        h = self.lin(x)
        return (h if self.warming_up else torch.tanh(h) * 2.0).square().mean()


def test_a_property_the_forward_reads_is_watched(caplog):
    """``self.warming_up``, a property reading a schedule outside the model, turned False after planning: the
    planned step kept the warm-up branch (found 2026-11-29; NOTE [properties the forward reads])."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(_ReadsAProperty().double(), (x,))
    try:
        for epoch in (0, 1, 0, 2):
            _SCHEDULE.epoch = epoch
            with caplog.at_level(logging.WARNING, logger="remat_plugin"):
                assert torch.equal(planned(x), reference(x)), epoch
    finally:
        _SCHEDULE.epoch = 0
    assert "warming_up (False, traced with True)" in caplog.text, caplog.text


_scaled = _helpers_file.scaled  # ``from helpers import scaled``


class _CallsHelpersOfAnotherFile(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return (_scaled(h) + _helpers_file.shifted(h)).square().mean()


def test_a_value_read_through_a_function_of_another_file_is_watched():
    """``scaled(h)`` of the user's other file reads that file's ``SCALE``, and through ``shifted`` its ``SHIFT``:
    silent constants before (found 2026-11-29; NOTE [a settings file's values])."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(_CallsHelpersOfAnotherFile().double(), (x,))
    try:
        for scale, shift in ((1.0, 0.0), (2.0, 0.0), (2.0, 0.5), (1.0, 0.0)):
            _helpers_file.SCALE, _helpers_file.SHIFT = scale, shift
            assert torch.equal(planned(x), reference(x)), (scale, shift)
    finally:
        _helpers_file.SCALE, _helpers_file.SHIFT = 1.0, 0.0


@dataclasses.dataclass
class _RunSettings:
    block: _BlockSettings = dataclasses.field(default_factory=_BlockSettings)
    lr: float = 0.1


_RUN = _RunSettings()


class _ReadsNestedSettings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x) * self.cfg.block.scale * _RUN.block.scale
        return (torch.sigmoid(h) * h if self.cfg.block.gated else h).square().mean()


@pytest.mark.parametrize("kind", ["dataclass", "namespace"])
def test_nested_settings_objects_are_watched(kind):
    """``self.cfg.block.scale`` of a dataclass in a dataclass (or a namespace in a namespace) held by the module,
    and ``_RUN.block.scale`` of a global one: only the outer object's plain fields were watched (found
    2026-11-29; NOTE [settings a module holds])."""
    torch.manual_seed(0)
    cfg = _RunSettings() if kind == "dataclass" else \
        types.SimpleNamespace(block=types.SimpleNamespace(scale=1.0, gated=False))
    x = torch.randn(4, 8, dtype=torch.float64)
    model = _ReadsNestedSettings(cfg).double()
    planned, reference = planned_beside_eager(model, (x,))
    try:
        for scale, gated, run_scale in ((1.0, False, 1.0), (2.0, False, 1.0), (2.0, True, 1.0), (1.0, False, 1.0),
                                        (1.0, False, 3.0), (1.0, False, 1.0)):
            for m in (model, reference):
                m.cfg.block.scale, m.cfg.block.gated = scale, gated
            _RUN.block.scale = run_scale
            assert torch.equal(planned(x), reference(x)), (scale, gated, run_scale)
    finally:
        _RUN.block.scale = 1.0


class _BranchesOnAnEpoch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.epoch = 0

    def forward(self, x):
        h = self.lin(x)
        return (h if self.epoch < 2 else torch.tanh(h)).square().mean()


def test_a_value_read_only_in_a_branch_condition_stays_watched(caplog):
    """``self.epoch < 2``: epoch 1 exported the same graph as epoch 0, so ``epoch`` was taken for a value not read
    and left the guard, and epoch 2 on ran epoch 0's branch, silently (found 2026-11-29; NOTE [values named in the
    code]).  A value the code names stays watched; changed at every step, it is told about again at its third
    capture."""
    torch.manual_seed(0)
    model = _BranchesOnAnEpoch().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        for epoch in (0, 1, 2, 3, 1):
            model.epoch = reference.epoch = epoch
            assert torch.equal(planned(x), reference(x)), epoch
    assert "epoch changed 3 times since planning" in caplog.text, caplog.text


class _HoldsFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = torch.tanh
        self.out_act = functools.partial(nn.functional.leaky_relu, negative_slope=0.1)

    def forward(self, x):
        return self.out_act(self.act(self.lin(x))).square().mean()


def test_a_function_a_module_holds_swapped_after_planning_takes_effect():
    """``block.act = torch.sigmoid`` and a new ``functools.partial``: the planned step ran the traced functions
    (found 2026-11-29; NOTE [functions a module holds])."""
    torch.manual_seed(0)
    model = _HoldsFunctions().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    for act, slope in ((torch.tanh, 0.1), (torch.sigmoid, 0.1), (torch.sigmoid, 0.3), (torch.tanh, 0.1)):
        for m in (model, reference):
            m.act, m.out_act = act, functools.partial(nn.functional.leaky_relu, negative_slope=slope)
        assert torch.equal(planned(x), reference(x)), (act, slope)


class _ClassSettingsBase(nn.Module):
    temperature = 1.0


class _ReadsClassAttributes(_ClassSettingsBase):
    use_tanh = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x) / self.temperature
        return (torch.tanh(h) if self.use_tanh else h).square().mean()


def test_a_class_attribute_changed_on_the_class_takes_effect():
    """``Base.temperature = 2.0`` and ``Cls.use_tanh = True``, set on the classes for every instance: the planned
    step held the traced values (found 2026-11-29; NOTE [class attributes the forward reads])."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(_ReadsClassAttributes().double(), (x,))
    try:
        for temperature, use_tanh in ((1.0, False), (2.0, False), (2.0, True), (1.0, False)):
            _ClassSettingsBase.temperature, _ReadsClassAttributes.use_tanh = temperature, use_tanh
            assert torch.equal(planned(x), reference(x)), (temperature, use_tanh)
    finally:
        _ClassSettingsBase.temperature, _ReadsClassAttributes.use_tanh = 1.0, False


class _Warmup:
    def __init__(self):
        self.warm = True
        self.scale = 1.0


class _Scaler:
    def __init__(self, s: float):
        self.s = s

    def __call__(self, h):
        return h * self.s


class _HoldsUserObjects(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.schedule = _Warmup()
        self.scaler = _Scaler(1.0)
        self.cfg = _BlockSettings()

    def forward(self, x):
        h = self.scaler(self.lin(x)) * self.schedule.scale * self.cfg.scale
        return (h if self.schedule.warm else torch.tanh(h)).square().mean()


def test_objects_of_the_user_s_classes_and_replaced_settings_are_watched():
    """A schedule object and a callable ``Scaler`` of the user's classes, changed in place, and a dataclass replaced
    by another (``model.cfg = Cfg(scale=2.0)``): silent constants (found 2026-11-29; NOTE [settings a module
    holds])."""
    torch.manual_seed(0)
    model = _HoldsUserObjects().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    for warm, scale, s, cfg_scale in ((True, 1.0, 1.0, 1.0), (False, 1.0, 1.0, 1.0), (False, 2.0, 1.0, 1.0),
                                      (False, 2.0, 3.0, 1.0), (False, 2.0, 3.0, 0.5), (True, 1.0, 1.0, 1.0)):
        for m in (model, reference):
            m.schedule.warm, m.schedule.scale, m.scaler.s = warm, scale, s
            m.cfg = _BlockSettings(scale=cfg_scale)
        assert torch.equal(planned(x), reference(x)), (warm, scale, s, cfg_scale)
