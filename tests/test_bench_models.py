"""Benchmark models and baseline peers: they build, run, match the unmodified model, and restore it."""

import pytest
import torch

from remat_plugin.bench.models import MODELS, BenchModel, build
from remat_plugin.bench.peers import EAGER_PEERS, applicable_peers, drop_cheap, none, per_layer_checkpoint, sqrt_n, sqrt_n_segments
from remat_plugin.capture.memory_meter import measure_peak

pytest.importorskip("transformers")

MODEL_NAMES = sorted(MODELS)
CHECKPOINTING_PEERS = [name for name in EAGER_PEERS if name != "none"]
# Gradient equality depends on structure, not size: a shorter GPT-2 batch keeps float64 runs quick.
SMALL = {
    "gpt2-tiny": {"batch_size": 2, "seq_len": 64}, "bert-tiny": {"batch_size": 2, "seq_len": 64},
    "llama-tiny": {"n_layer": 2, "batch_size": 2, "seq_len": 32}, "mistral-tiny": {"n_layer": 2, "batch_size": 2, "seq_len": 32},
    # grouped_mm, transformers' default experts, has no float64 CPU kernel: batched_mm has
    "mixtral-tiny": {"n_layer": 2, "batch_size": 2, "seq_len": 32, "experts": "batched_mm"},
    "t5-tiny": {"n_layer": 1, "batch_size": 2, "seq_len": 32}, "unet-tiny": {"batch_size": 2, "image_size": 16},
}  # fmt: skip


def _grads(bench: BenchModel, peer, batch_seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and parameter gradients of one step through ``peer``, dropout seeded identically."""
    bench.module.zero_grad(set_to_none=True)
    batch = bench.make_batch(batch_seed)
    with peer(bench) as step:
        torch.manual_seed(1234)
        loss = step(*batch)
        loss.backward()
    return loss.detach(), [p.grad for p in bench.module.parameters()]


def _peak_bytes(bench: BenchModel, peer) -> int:
    bench.module.zero_grad(set_to_none=True)
    batch = bench.make_batch(0)
    with peer(bench) as step:
        torch.manual_seed(0)
        _, peak = measure_peak(lambda: step(*batch).backward())
    return peak


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_builds_and_trains(name):
    """Each model runs forward+backward on CPU and every parameter gets a finite gradient."""
    bench = build(name)
    assert bench.module.training
    assert len(bench.layers) >= 4
    loss = bench.step(bench.make_batch(0))
    assert loss.dim() == 0
    loss.backward()
    for param in bench.module.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_builds_identical_models(name):
    """Two builds with one seed have equal parameters and batches, and leave the global RNG alone."""
    state = torch.random.get_rng_state()
    a, b = build(name, seed=3), build(name, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    for pa, pb in zip(a.module.state_dict().values(), b.module.state_dict().values()):
        assert torch.equal(pa, pb)
    (args_a, kwargs_a), (args_b, kwargs_b) = a.make_batch(7), b.make_batch(7)
    for ta, tb in zip([*args_a, *kwargs_a.values()], [*args_b, *kwargs_b.values()]):
        assert torch.equal(ta, tb)


def test_gpt2_layer_count_and_dtype_options():
    """gpt2-tiny takes an n_layer override and float64."""
    bench = build("gpt2-tiny", n_layer=12, dtype=torch.float64)
    assert bench.name == "gpt2-tiny-12l"
    assert len(bench.layers) == 12
    assert all(p.dtype == torch.float64 for p in bench.module.parameters())


def test_bert_masks_a_share_of_positions():
    """bert-tiny's batch masks about 15% of the positions, and only those carry a label."""
    bench = build("bert-tiny", batch_size=4, seq_len=128)
    _, kwargs = bench.make_batch(0)
    labelled = kwargs["labels"] != -100
    assert 0.08 < labelled.float().mean() < 0.22
    assert (kwargs["input_ids"][labelled] == bench.meta["vocab_size"] - 1).all()
    assert bench.name == "bert-tiny" and len(bench.layers) == 4


def test_unknown_model_raises():
    """Asking for a model that does not exist names the ones that do."""
    with pytest.raises(KeyError, match="choose one of"):
        build("resnet-huge")


@pytest.mark.parametrize("peer_name", CHECKPOINTING_PEERS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_peer_gradients_equal_none(name, peer_name):
    """In float64 with dropout active, a checkpointing peer's loss and gradients equal the plain model's bitwise."""
    bench = build(name, dtype=torch.float64, **SMALL.get(name, {}))
    if peer_name not in applicable_peers(bench, [peer_name]):
        with pytest.raises(ValueError, match="one chain"):
            _grads(bench, EAGER_PEERS[peer_name])
        return
    loss_ref, grads_ref = _grads(bench, none)
    loss, grads = _grads(bench, EAGER_PEERS[peer_name])
    assert torch.equal(loss, loss_ref)
    for grad, grad_ref in zip(grads, grads_ref):
        assert torch.equal(grad, grad_ref)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_layer_checkpoint_lowers_peak(name):
    """Per-layer checkpointing measures a lower peak than the plain model."""
    bench = build(name)
    assert _peak_bytes(bench, per_layer_checkpoint) < _peak_bytes(bench, none)


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "mlp-chain"])
def test_sqrt_n_lowers_peak(name):
    """Chen's segmentation also measures below the plain model."""
    bench = build(name)
    assert _peak_bytes(bench, sqrt_n) < _peak_bytes(bench, none)


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_drop_cheap_lies_between_none_and_per_layer(name):
    """Keeping matmul outputs saves less than per-layer checkpointing but still measures below the plain model."""
    bench = build(name)
    assert _peak_bytes(bench, per_layer_checkpoint) < _peak_bytes(bench, drop_cheap) < _peak_bytes(bench, none)


@pytest.mark.parametrize("peer_name", CHECKPOINTING_PEERS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_peer_restores_model(name, peer_name):
    """Leaving a peer, even by an exception, restores the layers' forward and the checkpointing switch."""
    bench = build(name, **SMALL.get(name, {}))
    params_before = list(bench.module.parameters())
    if peer_name not in applicable_peers(bench, [peer_name]):
        return
    with pytest.raises(ValueError, match="boom"), EAGER_PEERS[peer_name](bench):
        raise ValueError("boom")
    assert all("forward" not in layer.__dict__ for layer in bench.layers)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in bench.module.modules())
    assert all(a is b for a, b in zip(bench.module.parameters(), params_before))


def test_peers_use_the_models_own_parameters():
    """A peer's backward writes into the original Parameter objects."""
    bench = build("mlp-chain")
    with sqrt_n(bench) as step:
        step(*bench.make_batch(0)).backward()
    assert all(p.grad is not None for p in bench.module.parameters())


@pytest.mark.parametrize(
    ("n_layers", "sizes"),
    [(0, []), (1, [1]), (2, [2]), (4, [2, 2]), (8, [3, 3, 2]), (12, [4, 4, 4]), (16, [4, 4, 4, 4])],
)
def test_sqrt_n_segments(n_layers, sizes):
    """round(sqrt(n)) contiguous segments, sizes within one of each other, covering every layer once."""
    segments = sqrt_n_segments(n_layers)
    assert [len(s) for s in segments] == sizes
    assert [i for s in segments for i in s] == list(range(n_layers))
