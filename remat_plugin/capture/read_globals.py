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
    globals are the libraries' constants.  A value read through a function of another file, or a global
    container other than those (a dict), is not seen.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

_LIBRARIES = ("torch.", "transformers.")


def settings_object(v: Any) -> bool:
    """A settings object whose fields a forward reads: a namespace or a dataclass instance."""
    return isinstance(v, (argparse.Namespace, types.SimpleNamespace)) or \
        (dataclasses.is_dataclass(v) and not isinstance(v, type) and hasattr(v, "__dict__"))


@functools.lru_cache(maxsize=256)
def _names_read(cls: type) -> tuple[tuple[str, str], ...]:
    """``(module name, global name)`` pairs ``cls.forward`` and the functions it names in its file load."""
    forward = getattr(cls, "forward", None)
    if not isinstance(forward, types.FunctionType) or cls.__module__.startswith(_LIBRARIES):
        return ()
    found: dict[tuple[str, str], None] = {}
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
        codes = [fn.__code__]
        while codes:  # the function's code and the code nested in it (comprehensions, closures)
            code = codes.pop()
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            for name in code.co_names:
                # a method by its name on the class, read without running a descriptor (a property's getter)
                value = g[name] if name in g else inspect.getattr_static(cls, name, None)
                if name in g and not isinstance(value, (types.FunctionType, type, types.ModuleType)):
                    found[(module_name, name)] = None
                elif isinstance(value, types.FunctionType) and getattr(inspect.unwrap(value), "__globals__", None) is g \
                        and depth < 2:
                    todo.append((value, depth + 1))
    return tuple(found)


def globals_read(classes: set[type]) -> Iterator[tuple[Any, str, Any, str]]:
    """``(owner, name, value, where)`` for the plain-or-settings globals the classes' forwards read: ``owner``
    holds ``name`` in its ``vars()`` (a Python module for a global, the settings object for a field)."""
    for module_name, name in sorted({pair for cls in classes for pair in _names_read(cls)}):
        owner = sys.modules.get(module_name)
        if owner is None:
            continue
        value = vars(owner).get(name)
        if settings_object(value):
            for field, v in vars(value).items():
                yield value, field, v, f"{name}.{field} (a global of {module_name})"
        else:
            yield owner, name, value, f"{name} (a global of {module_name})"
