"""Transformers models as built from their config (``use_cache=True``) planned by the plain API
(NOTE [training without the cache] in remat_plugin/runtime/hf_cache.py)."""
import logging

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from remat_plugin import rematerialize
from remat_plugin.runtime.hf_cache import cached_configs, disable_hf_cache

VOCAB = 200


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":  # dropout left on (HF's defaults), use_cache left at its default
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64)
        model = GPT2LMHeadModel(config)
    elif family == "t5":  # an encoder-decoder: its decoder stack has a config of its own
        config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          decoder_start_token_id=0, pad_token_id=0)
        model = T5ForConditionalGeneration(config)
    else:
        config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
        model = LlamaForCausalLM(config)
    assert model.config.use_cache
    return model.double().train()


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 32), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 24:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _grads(model: torch.nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_default_config_is_planned_not_a_fallback_with_exact_gradients(family, caplog):
    """A model with the cache on by default is captured and planned (no per-layer-checkpointing fallback); three
    steps at 0.6 of the unmodified peak give bitwise the losses and gradients of the unmodified model called
    without the cache, and within 1e-12 of it called with the cache (float64, dropout on); the config is set back
    after each call, so evaluation still returns the cache."""
    ref, model, cached = _model(family), _model(family), _model(family)
    disable_hf_cache(ref)
    n_cached = len(cached_configs(model))
    peak = rematerialize(_model(family), (), _batch(0), budget=10**12, verbose=False).plan.baseline_peak_bytes
    assert peak > 0
    with caplog.at_level(logging.INFO, logger="remat_plugin"):
        rm = rematerialize(model, (), _batch(0), budget=int(peak * 0.6), verbose=True)
    assert rm.plan.fallback is None
    assert rm.plan.predicted_peak_bytes <= rm.plan.budget_bytes
    assert any("use_cache=False" in r.getMessage() for r in caplog.records)
    assert len(cached_configs(model)) == n_cached  # every config set back (T5's decoder stack's too)
    for step in range(3):
        torch.manual_seed(step)
        ours = rm(**_batch(step)).loss
        ours.backward()
        torch.manual_seed(step)
        theirs = ref(**_batch(step)).loss
        theirs.backward()
        torch.manual_seed(step)
        cached(**_batch(step)).loss.backward()
        assert torch.equal(ours, theirs)
        mine, oracle, with_cache = _grads(model), _grads(ref), _grads(cached)
        assert mine.keys() == oracle.keys() == with_cache.keys()
        for name in oracle:
            assert torch.equal(mine[name], oracle[name]), name
            torch.testing.assert_close(mine[name], with_cache[name], rtol=1e-12, atol=1e-15)
        for m in (model, ref, cached):
            m.zero_grad(set_to_none=True)
    assert len(cached_configs(model)) == n_cached
    assert rm.plan.fallback is None
    rm.eval()
    with torch.no_grad():
        assert rm(**_batch(0)).past_key_values is not None  # the caller's own setting, outside training


def test_a_call_asking_for_the_cache_falls_back_and_names_the_fix():
    """A training call that passes use_cache=True is left as asked: the cache cannot be captured, so the model
    is checkpointed layer by layer, and the reason says to call it with use_cache=False."""
    model = _model("gpt2")
    rm = rematerialize(model, (), {**_batch(0), "use_cache": True}, budget="1GiB", verbose=False)
    assert rm.plan.fallback is not None
    assert "call the model with use_cache=False" in rm.plan.fallback
    assert model.config.use_cache


def test_gqa_llama_without_a_mask_is_eager_within_the_last_bits():
    """The README's known limit, measured: a grouped-query Llama called without a padding mask traces a materialised
    causal mask (transformers builds it while tracing) where eager passes ``is_causal=True, enable_gqa=True``, so
    the key/value projections' gradients may differ from eager's in the last bits (at most 2e-15 of the largest
    gradient, float64: below 5e-16 on the CPU this was found on, 5.7e-16 on another, bitwise equal on a third; it
    depends on the kernels' summation order) while the loss is bitwise; with a padding mask the step is bitwise (the test above)."""
    ref, model = _model("llama"), _model("llama")
    disable_hf_cache(ref)
    ids = _batch(0)["input_ids"]
    rm = rematerialize(model, (), {"input_ids": ids, "labels": ids}, budget=10**12, verbose=False)
    assert {"le", "where"} <= {o.name for o in rm.problem.ops}  # the mask, built while tracing
    ours = rm(input_ids=ids, labels=ids).loss
    ours.backward()
    theirs = ref(input_ids=ids, labels=ids).loss
    theirs.backward()
    assert torch.equal(ours, theirs)
    mine, oracle = _grads(model), _grads(ref)
    # Whether any gradient differs at all depends on the CPU's summation order (bitwise equal on some machines of
    # this kind): the test bounds the difference and never requires one.
    differ = {name for name in oracle if not torch.equal(mine[name], oracle[name])}
    assert all(n.endswith(("k_proj.weight", "v_proj.weight", "input_layernorm.weight")) for n in differ), differ
    for name in oracle:
        assert (mine[name] - oracle[name]).abs().max() <= 2e-15 * oracle[name].abs().max(), name


def _packed(seed: int) -> dict:
    """Three sequences packed in each row, positions restarting at 0, no attention_mask (a padding-free collator)."""
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    positions = torch.tensor([list(range(10)) + list(range(8)) + list(range(6))] * 2)
    return {"input_ids": ids, "position_ids": positions, "labels": ids}


def test_packed_sequences_are_kept_apart_as_without_the_cache_and_said_once(caplog):
    """NOTE [packed sequences without the cache]: with its cache on, the model lets packed sequences attend to each
    other (its gradients far from the same model's with use_cache=False); the planned steps run without the cache,
    so they keep them apart, bitwise the model called with use_cache=False, and say so once."""
    model, without, with_cache = _model("llama"), _model("llama"), _model("llama")
    disable_hf_cache(without)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, budget=10**12, verbose=False)
        for seed in (0, 1):
            for m in (rm, without, with_cache):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                m(**_packed(seed)).loss.backward()
            ours, oracle, cached = _grads(model), _grads(without), _grads(with_cache)
            assert all(torch.equal(ours[n], oracle[n]) for n in oracle)
            assert max(((cached[n] - oracle[n]).abs().max() / oracle[n].abs().max()).item() for n in oracle) > 1e-3
    assert caplog.text.count("keeps sequences packed in position_ids apart only without a cache") == 1
    caplog.clear()
    plain = _model("llama")
    plain.config.use_cache = False  # the caller's own calls keep the packing too: nothing to say
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rematerialize(plain, budget=10**12, verbose=False)(**_packed(0)).loss.backward()
    assert "position_ids" not in caplog.text


def test_a_session_on_a_model_whose_cache_an_adapter_turned_off_says_it_too(caplog):
    """The Lightning and Accelerate adapters turn the cache off for the whole run (disable_hf_cache): their
    session's packed training calls are said once as well, and trained as the model without the cache trains."""
    from remat_plugin.runtime.config import RematConfig
    from remat_plugin.runtime.session import RematSession

    model, without = _model("llama"), _model("llama")
    disable_hf_cache(model)
    disable_hf_cache(without)
    session = RematSession(model, RematConfig(budget=10**12, ilp_time_limit_s=0.2))
    model.forward = session.dispatcher(model.forward)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        for m in (model, model, without):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            m(**_packed(0)).loss.backward()
    assert caplog.text.count("keeps sequences packed in position_ids apart only without a cache") == 1
    ours, oracle = _grads(model), _grads(without)
    assert all(torch.equal(ours[n], oracle[n]) for n in oracle)
