"""The planning problem as plain data: ops, the values they make, and schedules.

Every solver (block ILP, chain DP, whole-graph ILP) reads a :class:`Problem` and
returns a :class:`Schedule`; :mod:`remat_plugin.ir.simulate` is the single judge of
what a schedule costs in memory and time.

NOTE [schedule model]
    The forward phase always runs every forward op once, in ``Problem.ops`` order.
    A schedule only says what happens in the backward phase: ``bwd_sequence`` lists
    op names in execution order; each backward op appears exactly once and forward
    ops may appear any number of times (a recomputation).  Each op input reads the
    most recent copy of that value.  A value copy is freed right after its last
    read (or at once if nothing reads it), except values in
    ``Problem.live_out`` which stay until the end of the step.  The forward values
    read in the backward phase before any recomputation of them are the "kept" set:
    they survive the forward/backward boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Value:
    """A tensor storage produced by one op (views are folded into their base)."""

    name: str
    size_bytes: int
    producer: str  # name of the op that makes it


@dataclass(frozen=True)
class Op:
    """One schedulable computation."""

    name: str
    is_fwd: bool
    inputs: tuple[str, ...]  # Value names it reads (values from outside the problem are omitted)
    outputs: tuple[str, ...]  # Value names it makes
    time_ms: float
    temp_bytes: int = 0  # transient bytes while it runs (workspace), on top of inputs and outputs
    recomputable: bool = True  # False: never appears in bwd_sequence if forward


@dataclass(frozen=True)
class Incoming:
    """A value made outside the problem by the backward before it (a later block's gradient): alive when
    the backward phase starts, freed right after the last of ``readers`` (backward ops) runs."""

    name: str
    size_bytes: int
    readers: tuple[str, ...]


@dataclass(frozen=True)
class Problem:
    """A forward+backward graph: ``ops`` are all forward ops (execution order) then all backward ops."""

    ops: tuple[Op, ...]
    values: tuple[Value, ...]
    live_out: frozenset[str] = field(default_factory=frozenset)  # stay alive to the end (outputs, param grads)
    base_bytes: int = 0  # bytes alive for the whole step outside ``values`` (tangents, ...)
    incoming: tuple[Incoming, ...] = ()  # a block's gradients from later blocks (NOTE [incoming gradients])

    def op(self, name: str) -> Op:
        return self._ops_by_name()[name]

    def __getstate__(self) -> dict:
        """Fields only: the lookup indexes cached on the instance are rebuilt where needed."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def value(self, name: str) -> Value:
        return self._values_by_name()[name]

    def _ops_by_name(self) -> dict[str, Op]:
        cache = self.__dict__.get("_op_index")
        if cache is None:
            cache = {o.name: o for o in self.ops}
            object.__setattr__(self, "_op_index", cache)
        return cache

    def _values_by_name(self) -> dict[str, Value]:
        cache = self.__dict__.get("_value_index")
        if cache is None:
            cache = {v.name: v for v in self.values}
            object.__setattr__(self, "_value_index", cache)
        return cache

    @property
    def fwd_ops(self) -> tuple[Op, ...]:
        return tuple(o for o in self.ops if o.is_fwd)

    @property
    def bwd_ops(self) -> tuple[Op, ...]:
        return tuple(o for o in self.ops if not o.is_fwd)


@dataclass(frozen=True)
class Schedule:
    """What the backward phase runs; see NOTE [schedule model]."""

    bwd_sequence: tuple[str, ...]

    @staticmethod
    def keep_all(problem: Problem) -> Schedule:
        """The schedule of plain autograd: keep every forward value the backward reads."""
        return Schedule(tuple(o.name for o in problem.bwd_ops))
