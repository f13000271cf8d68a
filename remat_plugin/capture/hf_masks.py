"""transformers' attention masks built under ``torch.export`` as eager builds them, where that reads no values.

NOTE [masks under export]
    transformers skips building a bidirectional attention mask for SDPA when no token is masked
    (``attention_mask`` absent or all ones), but never while ``torch.compiler.is_exporting()``: reading
    the padding mask's values there would bake one batch's padding into the graph.  With no padding
    mask at all there is nothing to read, yet the exported model still got an all-True boolean mask
    where eager passes none.  BEiT (and Data2Vec-Vision) add that mask to their relative position bias,
    a boolean added as 1.0: every attention score shifted by one, the batch dimension broadcast in,
    and the gradients of a float64 BEiT 2e-13 off eager's.  An encoder without a bias ran SDPA's math
    kernel on a mask eager never built.  While a model is exported, a call without a padding mask
    gets eager's answer; with one, transformers' own (no value read).

    The causal check is alike: without a padding mask, eager skips the causal mask where every query sees
    every earlier key (as many queries as keys, or one) and SDPA runs ``is_causal=True``; the exported
    model built the mask, one row per batch element.  T5's decoder adds it to its relative position bias,
    so under bf16 autocast the bias's gradient was summed over the batch after SDPA's bf16 backward, where
    eager sums it inside: the decoder's bias gradient 1e-4 off eager's.  That decision reads no value either
    (the query offset it is also given only matters when there are fewer queries than keys), so it is
    eager's too.  Models that detect packed sequences from ``position_ids`` (Llama's family) still build
    the mask: whether a batch is packed is a value (README, Known limits).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

_SKIP_CHECK = "_ignore_bidirectional_mask_sdpa"
_CAUSAL_SKIP_CHECK = "_ignore_causal_mask_sdpa"
_EXPORTING = "is_torchdynamo_exporting"


@contextlib.contextmanager
def eager_masks() -> Iterator[None]:
    """Inside, transformers decides as eager does whether a bidirectional or causal mask without padding is
    needed (NOTE [masks under export]).  Nothing happens unless ``transformers.masking_utils`` is loaded."""
    masking = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as stack:
        for name, eager in ((_SKIP_CHECK, _as_eager), (_CAUSAL_SKIP_CHECK, _causal_as_eager)):
            check = getattr(masking, name, None)
            if check is None or not hasattr(masking, _EXPORTING) or getattr(check, "_remat_eager", False):
                continue
            setattr(masking, name, eager(masking, check))
            stack.callback(setattr, masking, name, check)
        yield


def _not_exporting(masking: Any, check: Callable[..., bool], *args: Any, **kwargs: Any) -> bool:
    """``check``'s answer as eager gives it, outside ``torch.export``."""
    exporting = getattr(masking, _EXPORTING)
    setattr(masking, _EXPORTING, lambda: False)
    try:
        return check(*args, **kwargs)
    finally:
        setattr(masking, _EXPORTING, exporting)


def _as_eager(masking: Any, check: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(check)
    def eager_check(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None:
            return check(padding_mask, *args, **kwargs)
        return _not_exporting(masking, check, padding_mask, *args, **kwargs)

    eager_check._remat_eager = True  # type: ignore[attr-defined]
    return eager_check


def _causal_as_eager(masking: Any, check: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(check)
    def eager_check(padding_mask: Any, q_length: int, kv_length: int, q_offset: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None or not (q_length == 1 or kv_length == q_length):
            return check(padding_mask, q_length, kv_length, q_offset, *args, **kwargs)
        # the offset (a tensor while tracing, which the check refuses to read) decides nothing here
        return _not_exporting(masking, check, padding_mask, q_length, kv_length, 0, *args, **kwargs)

    eager_check._remat_eager = True  # type: ignore[attr-defined]
    return eager_check
