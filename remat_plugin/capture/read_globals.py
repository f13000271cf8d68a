"""The module-level values a model's forward code names, which a traced graph holds as constants.

NOTE [globals the forward reads]
    A forward may read a value of its file rather than of its module: a global (``x * TEMPERATURE``), or a
    field of a global settings object (``args.dropout`` of an ``argparse.Namespace``, a ``SimpleNamespace`` or a
    dataclass instance).  The traced graph holds it as a constant, and a script changing it between steps (a
    schedule written as ``global TEMPERATURE``) trained with the old value, silently (found 2026-11-29).  The
    code of each model class's ``forward`` is read, with the functions and methods it names in its file (two
    levels, nested functions included), for the names it loads: those bound in its globals to a plain value, or
    to such a settings object (each of its plain fields), join the step's guard (NOTE [module attributes] in
    :mod:`remat_plugin.capture.module_attributes`).  torch's and transformers' own classes are not read: their
    globals are the libraries' constants.

NOTE [a settings file's values]
    ``import config as C`` and ``x * C.TEMPERATURE`` reads a value of another Python file, a module global to the
    forward's: its name skipped (a module is no value), ``C.TEMPERATURE = 2.0`` between steps was a silent
    constant (found 2026-11-29).  For a global bound to a module of the user's (not the standard library's, not
    torch's or transformers'), the attributes the code names that it holds join the guard: the code's names are
    those of every attribute read, so a name it reads of something else that the module also holds joins too, a
    value that does not change (and, changed, captured again once and then left out: not read).  The functions
    of the user's other files the code calls (``from helpers import scaled``, or ``helpers.scaled(h)``) are read
    as the forward's file's are, for the globals of their own files: a value read through one was not seen
    either (found 2026-11-29).  A module or function installed as a package (its file under ``site-packages``) is
    a library's, not read.

NOTE [properties the forward reads]
    A property read as ``self.current_epoch`` (Lightning's, reading the trainer's loop) or one of the user's
    (``self.warming_up``, reading a schedule object) is a value the guard did not see: it is in no ``__dict__``,
    and the graph holds what it returned when traced (found 2026-11-29).  The properties of a model class whose
    forward's code (and its file's helpers, as above) names them are read at every step; a plain value they
    return joins the guard (NOTE [module attributes]).  One that raises (Lightning's ``trainer`` with none
    attached) or returns anything else (a device, a dtype) is not watched.

NOTE [class attributes the forward reads]
    ``self.temperature`` read from the class (``class Block(nn.Module): temperature = 1.0``) and changed there
    (``Block.temperature = 0.5``, for every instance at once) was a silent constant: the guard held the instances'
    own values only (found 2026-11-29).  A plain value a class of the module's MRO holds under a name its forward's
    code names, where the module holds none of its own, is in the guard, its owner the class.

NOTE [values named in the code]
    A changed value whose new capture exports the same graph was taken for one the forward does not read and left
    the guard (NOTE [module attributes]).  A value read only in a branch's condition exports the same graph until
    the branch flips: ``h if self.epoch < 2 else torch.tanh(h)`` captured again at epoch 1, found the same graph,
    stopped watching ``epoch``, and ran epoch 0's branch from epoch 2 on, silently (found 2026-11-29).  A value
    whose name the code of the model's own classes holds (their forwards and the user's functions they call, as
    read above) now stays watched whatever the graph: each change captures again, and a value changed at every
    step is told about once more, at its third capture.  A value no code of the user's names (a step count the
    loop keeps on the model, a framework's bookkeeping) leaves the guard as before; so does one read only by
    torch's or transformers' own modules, whose code is not read.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

_LIBRARIES = ("torch.", "transformers.")
_NOT_USERS = ("torch", "transformers", "remat_plugin") + tuple(sys.stdlib_module_names)  # ours: our own objects
_MOST_FIELDS = 64  # a mapping of more is a table (a vocabulary), not settings


def settings_object(v: Any) -> bool:
    """A settings object whose fields a forward reads: a namespace, a dataclass instance, a mapping of a type of
    its own (Lightning's ``hparams``, an OmegaConf ``DictConfig``), or an object of a class of the user's (a
    schedule; NOTE [settings a module holds])."""
    return isinstance(v, (argparse.Namespace, types.SimpleNamespace)) or \
        (dataclasses.is_dataclass(v) and not isinstance(v, type) and hasattr(v, "__dict__")) or \
        (isinstance(v, Mapping) and type(v) not in (dict, OrderedDict) and not isinstance(v, type)) or \
        _users_object(v)


def _users_object(v: Any) -> bool:
    """An object of a class the user wrote (not torch's, a library's or the standard library's: no module, tensor,
    optimizer or trainer), holding its values in its ``__dict__``."""
    kind = type(v)
    if isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType)) or \
            not isinstance(getattr(v, "__dict__", None), dict):
        return False
    if any(str(k.__module__).partition(".")[0] in _NOT_USERS for k in kind.__mro__[:-1]):
        return False  # an nn.Module, a tensor, anything built on torch's classes
    return _users(kind.__module__, getattr(sys.modules.get(kind.__module__), "__file__", None))


def _users(module_name: str, file: str | None) -> bool:
    """Code of the user's: not the standard library's, torch's, transformers' or ours, not installed as a package
    (its file under ``site-packages``); a module with no file (a notebook's ``__main__``) is the user's."""
    return module_name.partition(".")[0] not in _NOT_USERS and "-packages" not in (file or "")


def fields(obj: Any) -> dict[str, Any]:
    """A settings object's fields by name: a mapping's string-keyed items, up to 64 (none where reading them fails:
    an OmegaConf value left missing), an object's ``vars()``."""
    if not isinstance(obj, Mapping):
        return vars(obj)
    try:
        return {k: v for k, v in obj.items() if type(k) is str} if len(obj) <= _MOST_FIELDS else {}
    except Exception:  # noqa: BLE001 - whatever a mapping's own lookup raises: nothing to watch
        return {}


_mapping_types: dict[type, bool] = {}


def is_mapping(obj: Any) -> bool:
    """``isinstance(obj, Mapping)``, by type, remembered: the guard asks it of every entry at every step."""
    kind = type(obj)
    known = _mapping_types.get(kind)
    if known is None:
        known = _mapping_types[kind] = isinstance(obj, Mapping)
    return known


def field(obj: Any, name: str, missing: Any) -> Any:
    """One field of a settings object, a module or an ``nn.Module``, as :func:`fields` reads it."""
    if not is_mapping(obj):
        return vars(obj).get(name, missing)
    try:
        return obj.get(name, missing)
    except Exception:  # noqa: BLE001 - as fields()
        return missing


def set_field(obj: Any, name: str, value: Any) -> None:
    if is_mapping(obj):
        obj[name] = value  # type: ignore[index]
    else:
        setattr(obj, name, value)


def _users_module(v: Any) -> bool:
    """A Python module of the user's: not the standard library's, torch's or transformers', not an installed one."""
    return isinstance(v, types.ModuleType) and _users(v.__name__, getattr(v, "__file__", None))


def _users_function(fn: Any, g: dict) -> bool:
    """A function whose code :func:`_names_read` reads: one of the same file as ``g``'s, or of a module of the
    user's (NOTE [a settings file's values])."""
    fn = inspect.unwrap(fn)
    if not isinstance(fn, types.FunctionType):
        return False
    return fn.__globals__ is g or _users(str(fn.__module__), fn.__code__.co_filename)


@functools.lru_cache(maxsize=256)
def _names_read(cls: type) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], frozenset[str]]:
    """``(module name, global name)`` pairs ``cls.forward`` and the functions of the user's it names load (two
    levels), the names of ``cls``'s properties they read (NOTE [properties the forward reads]), and every name
    their code holds (NOTE [values named in the code])."""
    forward = getattr(cls, "forward", None)
    if not isinstance(forward, types.FunctionType) or cls.__module__.startswith(_LIBRARIES):
        return (), (), frozenset()
    found: dict[tuple[str, str], None] = {}
    properties: dict[str, None] = {}
    every: set[str] = set()
    todo: list[tuple[types.FunctionType, int]] = [(forward, 0)]
    done: set[types.CodeType] = set()
    while todo:
        fn, depth = todo.pop()
        fn = inspect.unwrap(fn)  # a decorated forward (functools.wraps: @torch.autocast(...)): the model's own code
        if not isinstance(fn, types.FunctionType) or fn.__code__ in done:
            continue
        done.add(fn.__code__)
        g = fn.__globals__
        module_name = g.get("__name__", fn.__module__)  # where the names it loads live
        names: dict[str, None] = {}
        codes = [fn.__code__]
        while codes:  # the function's code and the code nested in it (comprehensions, closures)
            code = codes.pop()
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            names.update(dict.fromkeys(code.co_names))
        every.update(names)
        for name in names:
            # a method by its name on the class, read without running a descriptor (a property's getter)
            value = g[name] if name in g else inspect.getattr_static(cls, name, None)
            if isinstance(value, property) and name not in g:  # NOTE [properties the forward reads]
                properties[name] = None
            elif _users_module(value):  # NOTE [a settings file's values]
                found.update(((value.__name__, attr), None) for attr in names if attr in vars(value))
                if depth < 2:  # its functions the code names (``helpers.scaled(h)``)
                    todo.extend((f, depth + 1) for attr in names
                                if _users_function(f := vars(value).get(attr), g))
            elif name in g and not isinstance(value, (types.FunctionType, type, types.ModuleType)):
                found[(module_name, name)] = None
            elif isinstance(value, types.FunctionType) and _users_function(value, g) and depth < 2:
                todo.append((value, depth + 1))
    return tuple(found), tuple(properties), frozenset(every)


def named_in_code(classes: set[type]) -> frozenset[str]:
    """Every name the code of the classes' forwards and the user's functions they call holds: attributes read
    and globals loaded alike (NOTE [values named in the code])."""
    return frozenset().union(*(_names_read(cls)[2] for cls in classes))


def class_values_read(cls: type) -> Iterator[tuple[type, str, Any]]:
    """``(class, name, value)`` for the values the code of ``cls``'s forward names that a class of its MRO holds
    (NOTE [class attributes the forward reads]); methods and properties among them too, for the caller to skip."""
    for name in sorted(_names_read(cls)[2]):
        for k in cls.__mro__:
            if name in vars(k):
                yield k, name, vars(k)[name]
                break


def properties_read(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s properties its forward's code reads (NOTE [properties the forward reads])."""
    return _names_read(cls)[1]


def globals_read(classes: set[type]) -> Iterator[tuple[Any, str, Any, str]]:
    """``(owner, name, value, where)`` for the plain-or-settings globals the classes' forwards read: ``owner``
    holds ``name`` in its ``vars()`` (a Python module for a global, the settings object for a field)."""
    for module_name, name in sorted({pair for cls in classes for pair in _names_read(cls)[0]}):
        owner = sys.modules.get(module_name)
        if owner is None:
            continue
        value = vars(owner).get(name)
        if settings_object(value):
            for settings, key, v, where in settings_fields(value, name):
                yield settings, key, v, f"{where} (a global of {module_name})"
        else:
            yield owner, name, value, f"{name} (a global of {module_name})"


def settings_fields(obj: Any, where: str, nested: Callable[[Any], bool] = settings_object,
                    seen: set[int] | None = None) -> Iterator[tuple[Any, str, Any, str]]:
    """``(settings object, field, value, where)`` for the fields of ``obj`` and of the settings objects among them,
    two levels (``cfg.model.scale`` of nested dataclasses or namespaces: NOTE [settings a module holds]); each
    object once (``seen``, ids)."""
    seen = set() if seen is None else seen
    todo = [(obj, where, 0)]
    while todo:
        settings, at, depth = todo.pop()
        if id(settings) in seen:
            continue
        seen.add(id(settings))
        for key, v in fields(settings).items():
            if depth < 2 and nested(v):
                todo.append((v, f"{at}.{key}", depth + 1))
            else:
                yield settings, key, v, f"{at}.{key}"
