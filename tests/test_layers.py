"""The package's layers: imports go one way (down), no import cycles, no private names across modules.

Every ``import`` counts, including those inside functions: a lazy import hides a cycle from
Python, not from the design.
"""
from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lower number = lower layer.  A module may import its own layer and the layers below it.
# Layers of the same rank (capture, planning.solvers) are siblings and do not import each other.
LAYER_RANK = {
    "errors": 0,
    "torch_private": 1,  # imports only errors; the one home of private torch APIs
    "ir": 1,
    "capture": 2,
    "planning.solvers": 2,
    "planning": 3,
    "runtime": 4,
    "batch_size": 5,
    "integrations": 6,
    "cli": 6,
    "bench": 7,
}


def _module_files() -> dict[str, Path]:
    files = {}
    for base, prefix in ((ROOT / "remat_plugin", "remat_plugin"), (ROOT / "integrations", "remat_plugin.integrations")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([prefix, *parts])] = path
    return files


def _layer(module: str) -> str:
    rest = module.removeprefix("remat_plugin.")
    for layer in sorted(LAYER_RANK, key=len, reverse=True):
        if rest == layer or rest.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} is in no layer; add its folder to LAYER_RANK")


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` for every import of our package in ``path``."""
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("remat_plugin"):
                continue
            names = [a.name for a in node.names]
            # "from pkg import submodule" imports the submodule
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            found += [(s, [], node.lineno) for s in subs]
            if len(subs) < len(names):
                found.append((target, [n for n in names if f"{target}.{n}" not in known], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("remat_plugin")]
    return found


def _graph() -> dict[str, list[tuple[str, list[str], int]]]:
    files = _module_files()
    return {m: _imports(m, p, set(files)) for m, p in files.items()}


def test_imports_go_down_the_layers():
    """No module imports a layer above its own, or a sibling layer; nothing imports the package facade."""
    bad = []
    for module, imports in _graph().items():
        if module == "remat_plugin":
            continue  # the facade re-exports the public API from above
        own = _layer(module)
        for target, _, line in imports:
            if target == "remat_plugin":
                bad.append(f"{module}:{line} imports the package facade; import the defining module")
                continue
            other = _layer(target)
            if other != own and LAYER_RANK[other] >= LAYER_RANK[own]:
                bad.append(f"{module}:{line} ({own}) imports {target} ({other})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    """The module import graph (lazy imports included) has no cycle."""
    graph = {m: sorted({t for t, _, _ in imps if t != m and t != "remat_plugin"}) for m, imps in _graph().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph.get(m, []):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]) if t in path else f"{m} -> {t}")
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_private_names_across_modules():
    """A ``_name`` belongs to its module: other modules import only public names."""
    bad = [f"{module}:{line} imports {name} from {target}"
           for module, imports in _graph().items() for target, names, line in imports
           for name in names if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


PRIVATE_TORCH = re.compile(r"\btorch(\.[A-Za-z_]+)*\._[A-Za-z]|from torch(\.[A-Za-z_]+)*\._|\bfx\._[A-Za-z]")


def _code_lines(path: Path) -> dict[int, str]:
    """Each line's code without strings and comments (docstrings may name private APIs)."""
    lines: dict[int, str] = {}
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.NAME, tokenize.OP):
                line = lines.get(tok.start[0], "")
                space = " " if tok.type == tokenize.NAME and line[-1:].isidentifier() else ""
                lines[tok.start[0]] = line + space + tok.string
    return lines


def test_private_torch_apis_only_in_torch_private():
    """Private torch APIs change between releases: each is reached through ``remat_plugin.torch_private`` only."""
    found = []
    for module, path in _module_files().items():
        if module == "remat_plugin.torch_private":
            continue
        for lineno, code in _code_lines(path).items():
            if PRIVATE_TORCH.search(code) and "torch.ops.aten._" not in code:
                found.append(f"{path.relative_to(ROOT)}:{lineno}: {code}")
    assert not found, "\n".join(found)
