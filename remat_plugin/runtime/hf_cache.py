"""A transformers model's key/value cache, off while a planned training call runs.

NOTE [training without the cache]
    A transformers language model built from its config has ``use_cache=True``: its training
    forward returns a ``DynamicCache`` holding every layer's keys and values.  ``torch.export``
    cannot capture that object, so before this the plain ``rematerialize`` fell back to per-layer
    checkpointing (budget unverified) on GPT-2, Llama and the rest as users build them.  A training
    step has no use for the cache (transformers itself turns it off under gradient checkpointing),
    so a planned training call runs with ``config.use_cache=False``: bitwise the loss, logits and gradients
    of the model called with ``use_cache=False`` (with the cache on, HF's GPT-2 rounds its gradients
    otherwise in the last bits: within 1e-12 in float64; ``tests/test_hf_cache.py``).  The config is set back after the call: evaluation, ``generate()``
    and the caller's own calls of the model see it as they left it.  A call that passes ``use_cache``
    itself is left as it asked.  The Lightning and Accelerate adapters turn the cache off for the
    whole run instead (:func:`disable_hf_cache`) and say so.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

_off_for_good: dict[int, weakref.ref] = {}  # configs disable_hf_cache turned off, by id (configs are unhashable)
_told_packing: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def cached_configs(target: nn.Module) -> list[tuple[str, Any]]:
    """``(class name, config)`` of the transformers models inside ``target`` whose config has the cache on,
    each config once (a causal LM and its inner model share one)."""
    found: dict[int, tuple[str, Any]] = {}
    for m in target.modules():
        config: Any = m.__dict__.get("config")  # a plain attribute on transformers models; getattr's miss was slow
        if getattr(config, "use_cache", False) and hasattr(m, "can_generate") and id(config) not in found:
            found[id(config)] = (type(m).__name__, config)
    return list(found.values())


def disable_hf_cache(target: nn.Module) -> list[str]:
    """Set ``config.use_cache=False`` on transformers models inside ``target`` for good; their class names.

    A training forward that returns the key/value cache keeps every layer's keys and values
    alive past the step, and the cache object cannot be captured.  Transformers makes the same
    switch when its own gradient checkpointing is on.
    """
    found = cached_configs(target)
    for _, config in found:
        config.use_cache = False
        _off_for_good[id(config)] = weakref.ref(config)
    return [name for name, _ in found]


def say_packing_honoured(target: nn.Module, kwargs: dict, turned_off: bool) -> None:
    """NOTE [packed sequences without the cache]
        transformers reads sequences packed in one row from ``position_ids`` (each sequence restarting at 0,
        as padding-free collators pass them) only when a call has no ``attention_mask`` and no cache: its
        mask then keeps each sequence to itself.  A model with its cache on (the config default) ignores the
        packing in training calls, so the packed sequences attend to each other.  Planned calls run without
        the cache, so they honour it: their gradients are those of the model called with
        ``use_cache=False``, not of its calls with the cache on (a tiny packed Llama: off by up to 1.29 times the largest gradient).
        Such a call is said once per model, with the way to make the two the same (``rematerialize``, the
        adapters' sessions, ``rematerialize_fsdp``).
    """
    if target in _told_packing or kwargs.get("attention_mask") is not None or \
            not isinstance(kwargs.get("position_ids"), torch.Tensor):
        return
    if not turned_off and not any(_turned_off_for_good(config) for config in _configs(target)):
        return
    _told_packing.add(target)
    log.warning(
        "remat_plugin: %s is called with position_ids and no attention_mask, with its key/value cache turned off "
        "for planned training calls. transformers keeps sequences packed in position_ids apart only without a "
        "cache, so these steps honour the packing where the model with its cache on lets the packed sequences "
        "attend to each other: the gradients are those of the model called with use_cache=False. Set "
        "model.config.use_cache = False to have your own calls do the same (or pass an attention_mask)",
        type(target).__name__)


def _turned_off_for_good(config: Any) -> bool:
    ref = _off_for_good.get(id(config))
    return ref is not None and ref() is config  # an id outlives its object: the reference tells


def _configs(target: nn.Module) -> list[Any]:
    return [m.__dict__["config"] for m in target.modules() if "config" in m.__dict__]


@contextlib.contextmanager
def cache_off(target: nn.Module, kwargs: dict) -> Iterator[list[str]]:
    """Inside, the transformers models in ``target`` run without their cache (NOTE [training without the cache]),
    unless ``kwargs`` asks for ``use_cache`` itself; yields the class names turned off."""
    found = [] if "use_cache" in kwargs else cached_configs(target)
    for _, config in found:
        config.use_cache = False
    try:
        yield [name for name, _ in found]
    finally:
        for _, config in found:
            config.use_cache = True
