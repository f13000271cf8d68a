"""Python values held by the model's modules, which a traced graph holds as constants.

NOTE [module attributes]
    A planned step runs programs made from the traced graph, not the modules' Python, so every
    Python value the forward read while it was traced is a constant of the step: a temperature
    (``logits / self.temperature``), a dropout's ``p``, a BatchNorm's ``momentum``, a submodule's
    ``training`` flag (a BatchNorm put in eval mode to freeze it), a transformers config's
    ``output_hidden_states``.  Changing one after planning used to change nothing, silently.

    Which values a forward reads cannot be seen from outside (the FX tracer under ``torch.export``
    replaces ``nn.Module.__getattr__`` and wraps modules in proxies), so each step is guarded by every
    plain value (bool, number, string, None, a short tuple of them) in its modules' ``__dict__``s and
    in the transformers configs they hold, and by its modules' submodules (one replaced by another, an
    activation swapped, is another graph), as they were when it was traced (:class:`Guard`;
    ``use_cache`` aside: planned calls run without the cache whatever it says, NOTE [training without
    the cache]), and by the tensor attributes its graph reads, by identity (NOTE [tensor attributes] in
    :mod:`remat_plugin.capture.export`).  A step whose guard no longer holds is built again (a new capture, its plan replayed
    where the graph is the same), and the first change of each value is warned about once, naming it
    and the fix: a value changed at every step belongs in a tensor buffer, an input of the step.  When
    the new capture exports the very graph the old one did, the values that changed are not read by
    the forward (a step counter a loop keeps on the model, a framework's bookkeeping): they leave every
    later guard (:func:`not_read`).  Values the forward writes itself (a call counter) leave it too,
    with a warning: a planned step does not run the forward's Python, so they do not change at its
    steps (``torch.export`` even puts them back after tracing; :func:`traced_values` reads them as the
    traced forward returns).

NOTE [shared submodules]
    A model that calls one submodule in several places (an ALBERT-style layer applied N times, a
    ``ModuleList([layer] * n)``) is run by ``torch.export``'s non-strict trace as a copy: the forward
    hook that reads the values as the traced forward returns sees other module objects, the shared
    one copied once per place.  Their plain values compare as they are; their submodules, watched by
    identity, are compared by name there, or every ``<submodules>`` entry read as written by the
    forward: a false warning, and the entries left the guard, so a submodule replaced after planning
    went unseen.

NOTE [values the forward sets]
    A forward may set a value from its inputs' sizes at every call: transformers' Swin layers clamp
    ``shift_size`` to 0 and ``window_size`` to the resolution where the window covers the whole input
    (the last stage of a 224-pixel Swin-T).  The first call changes it, each later call writes what is
    there, so the graph does not depend on it changing.  Read as a value the forward changes, it was
    warned about on every Swin model (keep it in a buffer: a false alarm) and left the guard.  When a
    trace writes values, they are set as the call leaves them and the model is traced once more
    (once per model and value): a trace that writes nothing and exports the same graph is a step
    eager runs from then on, and is kept with those values in its guard, nothing warned about.  A
    trace that writes again (a counter), or exports another graph (a branch taken at the first call
    only, such as an ActNorm initialising itself from the first batch), puts the values back and
    keeps the first trace, as before.

NOTE [values set on the module]
    A forward may read a value its module does not hold itself: a class attribute (``Dropout``-like modules
    reading ``self.p`` set on the class, transformers attention classes' ``is_causal``) or a default
    (``getattr(self, "scale", 1.0)``).  Setting it on the module after planning (``model.p = 0.5``) adds a
    name to the module's ``__dict__``, which the guard, made of the names it held, did not see: the planned step
    ran the old value, silently (found 2026-11-29).  Each module's guard also holds the names its ``__dict__``
    had as the traced forward returned; a plain value set under a new name since is a changed value, captured
    again like the others (and left out of the guard if the forward turns out not to read it).

NOTE [settings a module holds]
    A module may keep its settings in an object rather than in attributes of its own: ``self.cfg = cfg`` (a
    dataclass instance, an ``argparse.Namespace`` or a ``SimpleNamespace``), read as ``self.cfg.dropout``.  Only
    transformers' configs held as ``config`` were watched, so a changed field of such an object was a silent
    constant (found 2026-11-29).  The plain fields of each such object a module holds, under any name, are in
    the guard, as a transformers config's are.  A mapping of a type of its own is such an object, its string
    keys its fields: Lightning's ``self.hparams`` (an ``AttributeDict`` the module holds as ``_hparams``) and an
    OmegaConf ``DictConfig`` (``self.cfg.model.dropout``, its nested configs frozen as containers are) were
    silent constants too (found 2026-11-29).  The settings objects among an object's fields (``cfg.block.scale``,
    a dataclass in a dataclass or a namespace in a namespace; a transformers config nested in one) are watched
    field by field too, two levels deep: only the outer object's plain fields were (found 2026-11-29).  An
    object of a class the user wrote (a schedule: ``self.schedule.warm``; a callable ``Scaler`` reading
    ``self.s``) is such an object too, and each object a module holds is also watched by identity: one replaced
    (``model.cfg = Cfg(scale=2.0)``) was a silent constant, its old fields unchanged (found 2026-11-29).

NOTE [containers of values]
    A module may hold its values in a list or dict (``self.scales = [1.0, 2.0]``, ``self.opts = {"scale": 1.0}``;
    a transformers config's ``rope_scaling``), and a caller may change one in place (``model.scales[0] = 3.0``) or
    replace it.  Only bools, numbers, strings, None and short tuples of them were watched, so either was a silent
    constant (found 2026-11-29).  A list, tuple or dict (string keys) of such values, up to 64 items and two levels
    deep, is watched by a frozen copy (:class:`_Frozen`) compared at every step; larger ones (a classifier's
    ``id2label``) are not.  A mapping or mutable sequence of another type nested in one (an OmegaConf
    ``DictConfig`` or ``ListConfig``) is frozen as a dict or list is.

NOTE [default dtype]
    A forward that makes a tensor without a dtype (``torch.ones(n)``, ``torch.tensor(0.5)``) makes it in torch's
    default dtype, which the traced graph holds as a constant: a script setting ``torch.set_default_dtype`` after
    planning ran a step that failed inside the graph ("Tensor dtype mismatch") or computed in the old dtype
    (found 2026-11-29).  The default dtype is in every guard.

NOTE [forward replaced]
    Patching a module's forward after planning (``layer.forward = MethodType(patched, layer)``, or its class's
    ``Block.forward = patched``: an attention kernel swapped in, a LoRA or logging wrapper) changes what eager
    runs, but the planned step ran the traced graph of the old one, silently (found 2026-11-29).  The guard
    holds, per module, the function its call runs, by identity: one replaced captures again, and a wrapper that
    traces to the same graph (a logger around the old forward) leaves the guard, as a value not read does.  A
    torch function patched globally (``torch.tanh = ...``) is not seen.

NOTE [functions a module holds]
    A module may hold a function as a value rather than as a submodule: ``self.act = torch.tanh``, or
    ``functools.partial(F.leaky_relu, negative_slope=0.1)``.  Swapping it after planning (``block.act =
    torch.sigmoid``) changed what eager runs while the planned step ran the traced graph, silently (found
    2026-11-29): only plain values and submodules were watched.  Each function a module holds (a callable that is
    no module, tensor or class) is in the guard by identity, and so is one set later under a name its class has (a
    method shadowed).

NOTE [the guard's walk]
    The guard is read before every planned call, so its walk is a cost of every step: on resnet-tiny (381 entries,
    a 7-8 ms step on this CPU) it took 0.18 ms, reading each value, freezing it and comparing.  A value unchanged
    is mostly the very object the guard holds (plain values are immutable; containers are held as frozen copies and
    read one by one), so each owner's plain values are read in one ``operator.itemgetter`` call and compared by
    identity.  An owner whose values are other objects is compared as before; where they are equal (a value set
    again), its new objects are held for the identity test from then on.

NOTE [values set once]
    A forward that fills in a value left None (transformers' classification heads set
    ``config.problem_type`` from the labels at their first call) writes it once and then reads it.
    Such a value is set on the model as the eager first call would leave it, and stays in the guard
    with that value: the step traced is the one eager runs from then on, nothing is warned about,
    and the caller's own later change of it (another loss) captures again.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableSequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, cast

import torch
from torch import Tensor, nn

from remat_plugin.capture.read_globals import (
    class_values_read,
    field,
    globals_read,
    is_mapping,
    named_in_code,
    properties_read,
    set_field,
    settings_fields,
    settings_object,
)

log = logging.getLogger(__name__)

_SCALARS = (bool, int, float, str, type(None))
_LEFT_OUT = frozenset({"use_cache"})
_MISSING = object()

Entry = tuple[Any, str, Any, str]  # (owner: a module or a config, attribute, value, where in the model)

_not_read: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_told_written: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_told_changed: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_changes: weakref.WeakKeyDictionary[nn.Module, dict[str, int]] = weakref.WeakKeyDictionary()
_TOLD_AGAIN_AT = 3  # captures of one value, the third said again: it changes at every step


_SWAPPED = object()  # a submodule replaced, added or removed
_CHILDREN = "<submodules>"  # an entry for a module's submodules, by name and identity: one replaced is another graph
_OWN = "<attributes>"  # an entry for the names a module's __dict__ holds (NOTE [values set on the module])
_UNSET = object()  # the module held no value of its own when traced: the forward read its class's, or none
_FORWARD = "<forward>"  # an entry for the function a module's call runs (NOTE [forward replaced])
_DEFAULT_DTYPE = "<default dtype>"  # an entry for torch's default dtype (NOTE [default dtype])


class _Property(str):
    """An entry's name that is a property of its module's class: read with ``getattr`` (NOTE [properties the
    forward reads] in :mod:`remat_plugin.capture.read_globals`)."""


class _Held(str):
    """An entry's name under which a module holds a settings object, watched by identity: one replaced by another
    (``model.cfg = Cfg(scale=2.0)``) is a changed value (NOTE [settings a module holds])."""


def _read_property(module: Any, name: str) -> Any:
    try:
        return getattr(module, name)
    except Exception:  # noqa: BLE001 - whatever the getter raises (Lightning's trainer, none attached): unwatched
        return _MISSING


def _forward_of(module: Any) -> Any:
    """The function ``module``'s call runs: one set on the module (``m.forward = MethodType(f, m)``), else its
    class's; a bound method's function, the same for a copy of the module (NOTE [shared submodules])."""
    own = vars(module).get("forward")
    return getattr(own, "__func__", own) if own is not None else getattr(type(module), "forward", None)


def _children(module: Any) -> tuple[tuple[str, int], ...]:
    return tuple((name, id(child)) for name, child in module._modules.items())


@dataclass(frozen=True)
class _Frozen:
    """A list, dict or long tuple of plain values as it was when traced: a copy, since the caller may change the
    container in place (``model.scales[0] = 3.0``; NOTE [containers of values])."""

    kind: type
    items: tuple  # the values, frozen; a dict's as (key, value) pairs

    def thawed(self) -> Any:
        if issubclass(self.kind, Mapping):
            return cast(Any, self.kind)({k: _thawed(v) for k, v in self.items})
        return cast(Any, self.kind)([_thawed(v) for v in self.items])


def _frozen(v: Any, depth: int = 0) -> Any:
    """``v`` as an entry holds it: a plain container frozen (:class:`_Frozen`), anything else as it is."""
    kind = type(v)
    if kind in _SCALARS or depth >= 2 or not (kind in (list, tuple) or isinstance(v, (Mapping, MutableSequence))):
        return v
    try:  # a mapping's own lookup may raise (an OmegaConf value left missing): then it is no plain container
        if len(v) > 64:
            return v
        if kind is tuple and len(v) <= 8 and all(type(x) in _SCALARS for x in v):
            return v  # immutable already
        if isinstance(v, Mapping):
            items = list(v.items())
            if not all(type(k) is str for k, _ in items):
                return v
            return _Frozen(kind, tuple((k, _frozen(x, depth + 1)) for k, x in items))
        return _Frozen(kind, tuple(_frozen(x, depth + 1) for x in v))
    except Exception:  # noqa: BLE001
        return v


def _is_plain_frozen(f: Any) -> bool:
    if isinstance(f, _Frozen):
        return all(_is_plain_frozen(x) for x in ([v for _, v in f.items] if issubclass(f.kind, Mapping) else f.items))
    return type(f) in _SCALARS or (type(f) is tuple and len(f) <= 8 and all(type(x) in _SCALARS for x in f))


def _plain(v: Any) -> bool:
    """A bool, number, string or None, or a list, tuple or dict (string keys) of them, 64 items, two levels deep."""
    return _is_plain_frozen(_frozen(v))


def _watched(name: str, v: Any) -> bool:
    """A plain value the guard holds; containers under private names are nn.Module's own (``_buffers``, empty in
    a leaf) or a library's bookkeeping (transformers' ``_tp_plan``), which a forward does not branch on."""
    return _plain(v) and not (name.startswith("_") and type(v) in (list, dict, OrderedDict))


def _function_held(name: str, v: Any) -> bool:
    """A function a module holds as a value (``self.act = torch.tanh``, a ``functools.partial``), watched by
    identity (NOTE [functions a module holds]); its own forward has an entry of its own (NOTE [forward replaced])."""
    return callable(v) and not isinstance(v, (nn.Module, Tensor, type)) and name != "forward" and \
        not settings_object(v)  # a callable object of the user's class: its fields too (NOTE [settings a module holds])


def _thawed(v: Any) -> Any:
    return v.thawed() if isinstance(v, _Frozen) else v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b  # a tensor attribute: the step reads the very tensor (NOTE [tensor attributes])
    return type(a) is type(b) and a == b


def _is_config(v: Any) -> bool:
    return type(v).__module__.startswith("transformers.") and type(v).__name__.endswith("Config") and \
        hasattr(v, "to_dict")


def _settings_or_config(v: Any) -> bool:
    """A settings object, or a transformers config nested in one (a multimodal config's ``text_config``)."""
    return settings_object(v) or _is_config(v)


def snapshot(module: nn.Module) -> list[Entry]:
    """The plain values of ``module``'s submodules, of the transformers configs and settings objects they hold, and
    of the globals their forwards read."""
    entries: list[Entry] = [(torch, _DEFAULT_DTYPE, torch.get_default_dtype(), "torch's default dtype")]
    configs: dict[int, tuple[str, Any]] = {}
    class_values: dict[tuple[type, str], Any] = {}
    for path, sub in module.named_modules():
        entries.append((sub, _CHILDREN, _children(sub), f"{path}.{_CHILDREN}" if path else _CHILDREN))
        entries.append((sub, _OWN, frozenset(sub.__dict__), f"{path}.{_OWN}" if path else _OWN))
        entries.append((sub, _FORWARD, _forward_of(sub), f"{path}.forward" if path else "forward"))
        for owner, name, v in class_values_read(type(sub)):  # NOTE [class attributes the forward reads]
            if name not in sub.__dict__ and _watched(name, v):
                class_values[(owner, name)] = v
        for name in properties_read(type(sub)):
            v = _read_property(sub, name)
            if _watched(name, v):
                entries.append((sub, _Property(name), _frozen(v), f"{path}.{name}" if path else name))
        for name, v in sub.__dict__.items():
            if _watched(name, v) or _function_held(name, v):
                entries.append((sub, name, _frozen(v), f"{path}.{name}" if path else name))
            elif (name == "config" and _is_config(v)) or settings_object(v):  # NOTE [settings a module holds]
                entries.append((sub, _Held(name), v, f"{path}.{name}" if path else name))
                if id(v) not in configs:
                    configs[id(v)] = (f"{path}.{name}" if path else name, v)
    entries.extend((owner, name, _frozen(v), f"{owner.__name__}.{name} (a class attribute)")
                   for (owner, name), v in class_values.items())
    # NOTE [globals the forward reads]
    entries.extend((owner, name, _frozen(v), where) for owner, name, v, where in
                   globals_read({type(sub) for sub in module.modules()}) if _watched(name, v))
    seen: set[int] = set()
    for where, config in configs.values():
        entries.extend((owner, name, _frozen(v), at) for owner, name, v, at in
                       settings_fields(config, where, _settings_or_config, seen)
                       if name not in _LEFT_OUT and _watched(name, v))
    return entries


def _changed(entries: Iterable[Entry], skip: set[str]) -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for owner, name, value, where in entries:
        if name is _CHILDREN:
            now_tuple = _children(owner)
            if now_tuple == value:
                continue
            now_children = dict(now_tuple)
            if now_children != dict(value):
                base, was = where[: -len(_CHILDREN)], dict(value)
                out.extend((f"{base}{k}", _SWAPPED, _SWAPPED) for k in sorted(set(was) | set(now_children))
                           if was.get(k) != now_children.get(k) and f"{base}{k}" not in skip)
            continue
        if name is _OWN:  # NOTE [values set on the module]
            own = vars(owner)
            if len(own) != len(value) or not value.issuperset(own):
                base = where[: -len(_OWN)]
                # a value equal to the class's it shadows changes nothing (and would be found "not read")
                out.extend((f"{base}{k}", v, _UNSET) for k, v in own.items()
                           if k not in value and (_watched(k, v) or _function_held(k, v)) and f"{base}{k}" not in skip
                           and not _same(_frozen(v), _frozen(getattr(type(owner), k, _UNSET))))
            continue
        if name is _FORWARD:  # NOTE [forward replaced]
            now = _forward_of(owner)
            if now is not value and where not in skip:
                out.append((where, now, value))
            continue
        if type(name) is _Held:  # NOTE [settings a module holds]: by identity, its fields have entries of their own
            now = vars(owner).get(name, _MISSING)
            if now is not value and where not in skip:
                out.append((where, now, value))
            continue
        if name is _DEFAULT_DTYPE:
            now = torch.get_default_dtype()
        elif type(name) is _Property:
            now = _read_property(owner, name)
        else:
            now = field(owner, name, _MISSING)
        if not _same(_frozen(now), value) and where not in skip:
            out.append((where, now, value))
    return out


_MARKERS = frozenset({_CHILDREN, _OWN, _FORWARD, _DEFAULT_DTYPE})


class _ByIdentity:
    """A guard's entries arranged for its walk at every step (NOTE [the guard's walk]): the plain values each owner's
    ``__dict__`` holds, read in one ``itemgetter`` call and compared by identity, and the other entries."""

    def __init__(self, entries: tuple[Entry, ...]):
        self.entries = entries
        groups: dict[int, tuple[Any, list[str], list[Any], list[int]]] = {}
        self.rest: list[int] = []  # indices of the entries read one by one, as _changed reads them
        for i, (owner, name, value, _) in enumerate(entries):
            if type(name) is str and name not in _MARKERS and not isinstance(value, _Frozen) and \
                    not is_mapping(owner) and hasattr(owner, "__dict__"):
                group = groups.setdefault(id(owner), (owner, [], [], []))
                group[1].append(name)
                group[2].append(value)
                group[3].append(i)
            else:
                self.rest.append(i)
        # [owner, read its values, the objects it held (one, or a tuple of them), the entries' indices]
        self.groups = [[owner, operator.itemgetter(*names), tuple(values) if len(values) > 1 else values[0], indices]
                       for owner, names, values, indices in groups.values()]

    def suspects(self) -> list[Entry]:
        """The entries that may have changed, in their order: every owner's whose values are not all the very objects
        traced, and the rest."""
        entries, indices = self.entries, list(self.rest)
        for group in self.groups:
            owner, read, held, owned = group
            try:
                now = read(vars(owner))
            except (KeyError, TypeError):  # a value deleted: read each one
                indices.extend(owned)
                continue
            if now is held:
                continue
            several = len(owned) > 1
            if several and all(map(operator.is_, now, held)):
                continue
            pairs = zip(now, held) if several else ((now, held),)
            if all(_is_plain_frozen(a) and _same(a, entries[i][2])
                   for (a, _), i in zip(pairs, owned)):
                group[2] = now  # equal immutable values, other objects (set again): the same from now on
                continue
            indices.extend(owned)
        indices.sort()
        return [entries[i] for i in indices]


@dataclass
class Guard:
    """The values a traced step holds as constants, as they were when it was traced (NOTE [module attributes])."""

    model: Any  # weakref.ref to the model the values are of
    entries: tuple[Entry, ...]
    # Built at the first walk: export's guard is replaced by with_tensors' before any walk.
    _walk: _ByIdentity | None = dataclass_field(default=None, repr=False, compare=False)

    def changed(self) -> list[tuple[str, Any, Any]]:
        """``(where, now, traced with)`` of each value changed since, but those found not read."""
        if self._walk is None:
            self._walk = _ByIdentity(self.entries)
        model = self.model()
        return _changed(self._walk.suspects(), _not_read.get(model, set()) if model is not None else set())


class TracedValues:
    """The model's plain values before a trace and as its traced forward returned (``torch.export`` puts back
    what the forward assigned once the trace ends, so the values are read by a forward hook)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.before = snapshot(module)
        self.after: dict[str, Any] | None = None
        self.ran_a_copy = False

    def forward_returned(self, module: nn.Module, args: Any, output: Any) -> None:
        self.after = {where: value for _, _, value, where in snapshot(module)}
        self.ran_a_copy = module is not self.module  # NOTE [shared submodules]

    def _kept(self, name: str, before: Any, after: Any) -> bool:
        """Whether the traced forward left this value as it was."""
        if name is _CHILDREN and self.ran_a_copy:  # the copy's submodules are others: compare their names only
            return after is not _MISSING and [n for n, _ in after] == [n for n, _ in before]
        if name is _OWN or name is _FORWARD:  # what the trace sets is its own business: the names the forward adds
            return True  # (NOTE [values set on the module]), the layers' forwards a layered trace stands in for
        return _same(after, before)

    def _written(self) -> set[str]:
        after = self.after or {}
        return {where for _, name, value, where in self.before
                if not self._kept(name, value, after.get(where, _MISSING))} if self.after is not None else set()

    def left_as_the_forward_left_them(self) -> Callable[[], None] | None:
        """Sets the plain values the forward wrote, none of them told about yet, as its call leaves them, for a trace
        again (NOTE [values the forward sets]); returns what puts them back, or None where there are none."""
        written = self._written() - _told_written.get(self.module, set())
        entries = [e for e in self.before if e[3] in written]
        if not entries or any(name in (_CHILDREN, _FORWARD, _DEFAULT_DTYPE) or type(name) in (_Property, _Held)
                              for _, name, _, _ in entries) or \
                all(value is None for _, _, value, _ in entries):
            return None  # a submodule replaced; values set once only, which the guard sets (NOTE [values set once])
        after = self.after or {}
        for owner, name, _, where in entries:
            set_field(owner, name, _thawed(after[where]))

        def put_back() -> None:
            for owner, name, value, _ in entries:
                set_field(owner, name, _thawed(value))
        return put_back

    def wrote_nothing(self) -> bool:
        """Whether the traced forward left every value as it found it."""
        return not self._written()

    def guard(self) -> Guard:
        """The guard of the traced graph; says once which values the forward itself changed, which leave it.  A
        value the forward set where it was None stays in it, set as the forward set it (NOTE [values set once])."""
        module, after = self.module, self.after or {}
        written = self._written()
        entries = list(self.before)
        for i, (owner, name, value, where) in enumerate(entries):
            now = after.get(where, _MISSING)
            if name is _OWN:  # the names as the traced forward left them: what it added is not the caller's change
                entries[i] = (owner, name, value | now if now is not _MISSING else value, where)
                continue
            if where in written and value is None and now is not None and now is not _MISSING and \
                    type(name) not in (_Property, _Held):
                set_field(owner, name, _thawed(now))  # what the eager first call leaves behind; torch.export put it back
                entries[i] = (owner, name, now, where)
                written.discard(where)
        if written:
            _not_read.setdefault(module, set()).update(written)
            told = _told_written.setdefault(module, set())
            new = sorted(written - told)
            if new:
                told.update(new)
                log.warning(
                    "remat_plugin: %s's forward changes Python values (%s). A planned step runs the traced graph, "
                    "not the forward's Python, so they do not change at its steps. Keep such state in a tensor "
                    "buffer updated in place, or outside the model", type(module).__name__,
                    ", ".join(new[:3]) + (", ..." if len(new) > 3 else ""))
        return Guard(weakref.ref(module), tuple(e for e in entries if e[3] not in written))


@contextlib.contextmanager
def traced_values(module: nn.Module) -> Iterator[TracedValues]:
    """Inside, a trace of ``module``'s forward is watched for the values it reads and writes (NOTE [module
    attributes]); the record's :meth:`TracedValues.guard` is the traced graph's guard."""
    record = TracedValues(module)
    handle = module.register_forward_hook(record.forward_returned)
    try:
        yield record
    finally:
        handle.remove()


def not_read(module: nn.Module, changed: Iterable[tuple[str, Any, Any]]) -> None:
    """These values changed and the new capture exported the same graph: the forward does not read them, unless
    its code names them (NOTE [values named in the code] in :mod:`remat_plugin.capture.read_globals`: a branch's
    condition).  A replaced submodule or tensor stays watched: the graph runs the tensor, and another module may
    trace otherwise."""
    named = named_in_code({type(m) for m in module.modules()})
    _not_read.setdefault(module, set()).update(
        where for where, now, was in changed if now is not _SWAPPED and not isinstance(now, Tensor)
        and not isinstance(was, Tensor) and _attribute_name(where) not in named)


def _attribute_name(where: str) -> str:
    """The name a value has in code, from where an entry says it is (``layers.0.p``, ``TEMPERATURE (a global of
    m)``, ``cfg.block.scale (a global of m)``, ``Block.scale (a class attribute)``)."""
    return where.split(" (")[0].rsplit(".", 1)[-1]


def with_tensors(guard: Guard, module: nn.Module, tensors: dict[str, Tensor]) -> Guard:
    """``guard`` and the tensor attributes of ``module`` the graph reads, by target (NOTE [tensor attributes] in
    :mod:`remat_plugin.capture.export`), by identity: one replaced is a changed value."""
    extra = []
    for target, tensor in tensors.items():
        path, _, name = target.rpartition(".")
        try:
            owner = module.get_submodule(path) if path else module
        except AttributeError:  # made by the forward (a lifted constant): no attribute of the model to replace
            continue
        if vars(owner).get(name) is tensor:
            extra.append((owner, name, tensor, target))
    return Guard(guard.model, guard.entries + tuple(extra))


def say_changed(module: nn.Module, changed: list[tuple[str, Any, Any]]) -> None:
    """Warn once per value that it changed since its step was traced, which builds the step again."""
    told = _told_changed.setdefault(module, set())
    new = [(where, now, was) for where, now, was in changed if where not in told]
    if new:
        told.update(where for where, _, _ in new)
        log.warning(
            "remat_plugin: %s's %s changed since its step was traced. A planned step holds the Python values its "
            "forward read as constants, so the model is captured again (about a second; its plan is replayed where "
            "the graph is the same, and a value the forward turns out not to read is not watched again). To change "
            "a value at every step, hold it in a tensor buffer (register_buffer), an input of the step",
            type(module).__name__, ", ".join(f"{where} (replaced by another module)" if now is _SWAPPED else
                                             f"{where} ({_shown(now)}, traced with {_shown(was)})"
                                             for where, now, was in new[:3]))
    counts = _changes.setdefault(module, {})
    for where, _, _ in changed:
        counts[where] = counts.get(where, 0) + 1
    often = [where for where, _, _ in changed if counts[where] == _TOLD_AGAIN_AT]
    if often:  # NOTE [values named in the code]: a value the code names stays watched whatever the graph
        log.warning(
            "remat_plugin: %s's %s changed %d times since planning, each change capturing the model again (about a second "
            "each): the forward's code names it, so it may decide a branch and stays watched. If it changes at every "
            "step, hold it in a tensor buffer (register_buffer), an input of the step, or compute the branch outside "
            "the model", type(module).__name__, ", ".join(often[:3]), _TOLD_AGAIN_AT)


def _shown(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    if v is _UNSET:
        return "no value of the module's own: its class's, or none"
    return "gone" if v is _MISSING else repr(_thawed(v))
