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
from collections.abc import Iterator
from typing import Any

from torch import nn


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
    return [name for name, _ in found]


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
