"""Rank helpers: one place that asks ``torch.distributed`` who we are and exchanges small objects.

Without an initialized process group every helper answers as the only process, so the same
code runs in one process and under DDP.

NOTE [a failure reaches every rank]: a rank that raises between two collectives leaves the
others waiting in the next one until the process group times out, or, once its process
exits, failing there with gloo's "Connection closed by peer" instead of the real error.  So
work done between collectives on some ranks only runs in :func:`on_every_rank`,
:func:`gathered` or :func:`from_rank_zero`: the exception is caught, its text travels in the
collective that follows anyway, and every rank raises -- the failing rank its own exception,
the others a :class:`RematError` that names the rank and carries the same text.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from remat_plugin.errors import RematError

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def copies_collective_inputs() -> bool:
    """gloo (CPU) runs collectives on its own threads, on a clone of the input freed when the thread is done."""
    return is_distributed() and dist.get_backend() == "gloo"


def is_rank_zero() -> bool:
    return rank() == 0


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_from_rank_zero(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself in one process)."""
    if world_size() == 1:
        return obj
    payload = [obj]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


# --- failures that reach every rank: NOTE [a failure reaches every rank] ------------------------
def gathered(fn: Callable[[], T], doing: str) -> list[T]:
    """``fn()`` on every rank; every rank's result (picklable), in rank order.  Raises on every rank if it
    raised on any; ``doing`` says what failed ("computing its budget")."""
    value, error = _attempt(fn)
    results = all_gather((value, _text(error)))
    _raise_if_failed(doing, error, [text for _, text in results])
    return [v for v, _ in results]


def on_every_rank(fn: Callable[[], T], doing: str) -> T:
    """``fn()`` on every rank; this rank's result (it need not pickle).  Raises on every rank if it raised on any."""
    value, error = _attempt(fn)
    _raise_if_failed(doing, error, all_gather(_text(error)))
    return value  # type: ignore[return-value]  # None only when fn raised, and then we raised


def from_rank_zero(fn: Callable[[], T], doing: str) -> T:
    """``fn()`` on rank 0 only; its result (picklable) on every rank.  Raises on every rank if it raised."""
    value, error = _attempt(fn) if is_rank_zero() else (None, None)
    value, text = broadcast_from_rank_zero((value, _text(error)))
    _raise_if_failed(doing, error, [text])
    return value  # type: ignore[return-value]


def _attempt(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 -- anything, out of memory too: every rank must hear of it
        return None, exc


def _text(error: Exception | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def failed_with(err: Exception, kind: type[Exception]) -> bool:
    """``err`` is a ``kind`` raised on this rank, or the :class:`RematError` another rank's ``kind`` became here."""
    return isinstance(err, kind) or (isinstance(err, RematError) and kind.__name__ in str(err))


def _raise_if_failed(doing: str, error: Exception | None, texts: list[str | None]) -> None:
    """Raise ``error`` where it happened; on the other ranks, the first failure of ``texts`` (indexed by rank)."""
    if error is not None:
        raise error
    for failed, text in enumerate(texts):
        if text is not None:
            raise RematError(f"remat_plugin: rank {failed} failed while {doing}: {text} (its traceback is in rank "
                             f"{failed}'s output; every rank stops here)")
