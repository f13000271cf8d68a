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
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

_SKIP_CHECK = "_ignore_bidirectional_mask_sdpa"
_EXPORTING = "is_torchdynamo_exporting"


@contextlib.contextmanager
def eager_masks() -> Iterator[None]:
    """Inside, transformers decides as eager does whether a bidirectional mask without padding is needed
    (NOTE [masks under export]).  Nothing happens unless ``transformers.masking_utils`` is loaded."""
    masking = sys.modules.get("transformers.masking_utils")
    check = getattr(masking, _SKIP_CHECK, None)
    if check is None or not hasattr(masking, _EXPORTING) or getattr(check, "_remat_eager", False):
        yield
        return
    setattr(masking, _SKIP_CHECK, _as_eager(masking, check))
    try:
        yield
    finally:
        setattr(masking, _SKIP_CHECK, check)


def _as_eager(masking: Any, check: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(check)
    def eager_check(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None:
            return check(padding_mask, *args, **kwargs)
        exporting = getattr(masking, _EXPORTING)
        setattr(masking, _EXPORTING, lambda: False)
        try:
            return check(padding_mask, *args, **kwargs)
        finally:
            setattr(masking, _EXPORTING, exporting)

    eager_check._remat_eager = True  # type: ignore[attr-defined]
    return eager_check
