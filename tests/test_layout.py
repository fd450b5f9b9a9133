"""The package layout keeps its plan: no import cycles in agl_core, and every import points down.

Every ``import`` of every agl_core module counts, wherever it stands: at the top, inside a function (a lazy
import still ties the two modules together) or under ``if TYPE_CHECKING:`` (an annotation that names a module
above is a dependency on it). The rooms below are the map of ``docs/design-decisions.md``, bottom first; a
module belongs to the room that lists it or its package (the longest name wins; ``agl_core`` stands for the
package's ``__init__`` alone), and may import its own room and the rooms its room names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "agl_core"

ROOMS: list[tuple[str, list[str], set[str]]] = [
    # (room, its modules and packages, the rooms it may import)
    ("algorithms", ["agl_core.algorithms"], set()),
    ("http rules", ["agl_core.http.rules", "agl_core.http.recordable"], set()),
    ("contract", ["agl_core.data", "agl_core.lazy_import", "agl_core.hookspecs", "agl_core.plugins",
                  "agl_core.config", "agl_core.components", "agl_core.context", "agl_core.wiring",
                  "agl_core.timing", "agl_core.stop", "agl_core.batching", "agl_core.balance", "agl_core.metrics",
                  "agl_core.checkpoint", "agl_core.run_dir", "agl_core.policies", "agl_core.policy_rows"], {"algorithms", "http rules"}),
    ("http serving", ["agl_core.http"], {"http rules", "contract"}),
    ("rollout", ["agl_core.rollout"],
     {"http rules", "contract", "http serving"}),
    ("gateway", ["agl_core.gateway"], {"http rules", "contract", "http serving", "rollout"}),
    ("public names", ["agl_core"], {"contract", "rollout"}),
    # agl_core.builtin.plot and agl_core.builtin.trackers: the run's curves, which loggers send to trackers (agl_core.builtin after the move)
    ("builtin plugins", ["agl_core.builtin"],
     {"algorithms", "http rules", "contract", "http serving", "rollout", "gateway", "public names"}),
    ("rollout services", ["agl_core.rollout.runner_service", "agl_core.rollout.async_rollouts"],
     {"http rules", "contract", "http serving", "rollout", "gateway", "builtin plugins"}),
    ("loop", ["agl_core.loop"], {"algorithms", "contract", "rollout", "rollout services"}),
    ("testing", ["agl_core.testing"],
     {"algorithms", "http rules", "contract", "http serving", "rollout", "gateway", "public names", "builtin plugins",
      "rollout services", "loop"}),
    ("cli", ["agl_core.cli"],
     {"algorithms", "http rules", "contract", "http serving", "rollout", "gateway", "public names",
      "builtin plugins", "rollout services", "loop", "testing"}),
]

# The deprecation table and finder of moved modules, imported first by agl_core/__init__.py: it imports nothing
# of agl_core at import time (it names modules only as strings).
OUTSIDE_ROOMS = {"agl_core._moved"}


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path | None = None) -> dict[str, Path]:
    """Every module of the package (agl_core by default; the plugin template's files are data, not modules)."""
    package = package or PACKAGE
    found = {module_name(p, package.parent): p for p in package.rglob("*.py")
             if "templates" not in p.relative_to(package).parts}
    assert found, f"no modules under {package}"
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported agl_core module, line)`` for every import in the module, top-level, lazy or for type checking.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub if sub in known else source, node.lineno))
    top = name.partition(".")[0]
    return [(target, line) for target, line in found if (target == top or target.startswith(top + ".")) and target != name]


def graph(package: Path | None = None) -> dict[str, dict[str, int]]:
    """Module → {module of the same package it imports: the line of the first such import}."""
    known = modules(package)
    edges: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges[name] = {}
        for target, line in imports(name, path, known):
            # An import of a name that is no module of its own (``import agl_core.x.y`` of a function) is one of x.
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target != name:
                edges[name].setdefault(target, line)
    return edges


def room_of(module: str) -> str | None:
    best, best_len = None, -1
    for room, members, _ in ROOMS:
        for member in members:
            # "agl_core" is the package's own __init__ (its public names), not every module below it
            inside = member != "agl_core" and module.startswith(member + ".")
            if (module == member or inside) and len(member) > best_len:
                best, best_len = room, len(member)
    return best


def where(module: str, line: int, package: Path | None = None) -> str:
    return f"{modules(package)[module].relative_to(REPO)}:{line}"


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected group of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [cycle_in(sorted(group), edges) for group in groups]


def cycle_in(group: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle through the group's first module, staying in the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_every_module_is_in_a_room():
    unplaced = sorted(m for m in modules() if room_of(m) is None and m not in OUTSIDE_ROOMS)
    assert not unplaced, f"modules in no room of tests/test_layout.py ROOMS (add them, and to the map): {unplaced}"


PLUGIN_PACKAGES = sorted(p.parent for pattern in ("plugins/*/*/__init__.py", "examples/plugins/*/*/__init__.py")
                         for p in REPO.glob(pattern) if p.parent.name != "tests")


@pytest.mark.parametrize("package", [PACKAGE] + PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_no_import_cycles(package):
    edges = graph(package)
    found = cycles(edges)
    described = ["\n  ".join(f"{a} -> {b} ({where(a, edges[a][b], package)})" for a, b in zip(cycle, cycle[1:]))
                 for cycle in found]
    assert not found, "import cycles:\n  " + "\n\n  ".join(described)


def test_imports_point_down():
    rooms = {room: allowed for room, _, allowed in ROOMS}
    edges = graph()
    wrong = []
    for module, targets in sorted(edges.items()):
        source_room = room_of(module)
        if source_room is None:
            continue
        for target, line in sorted(targets.items()):
            if target in OUTSIDE_ROOMS:
                continue
            target_room = room_of(target)
            if target_room != source_room and target_room not in rooms[source_room]:
                wrong.append(f"{where(module, line)}: {module} ({source_room}) imports {target} ({target_room}), "
                             f"which {source_room!r} may not import")
    assert not wrong, "imports that do not point down (tests/test_layout.py ROOMS):\n" + "\n".join(wrong)


def test_checker_sees_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    """The checker itself: a function-level import and one under TYPE_CHECKING are both edges, and close a cycle."""
    root = tmp_path / "agl_core"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("def f():\n    from agl_core import b\n")
    (root / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agl_core.a import f\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE", root)
    edges = graph()
    assert edges["agl_core.a"] == {"agl_core.b": 2} and edges["agl_core.b"] == {"agl_core.a": 3}
    assert cycles(edges) == [["agl_core.a", "agl_core.b", "agl_core.a"]]


def moved_table() -> dict[str, str]:
    """The old -> new names of moved modules (agl_core/_moved.py, written by the layout script with the move)."""
    moved = pytest.importorskip("agl_core._moved", reason="the modules have not moved yet (no agl_core/_moved.py)")
    return moved.MOVED


def test_moved_modules_left_no_file_behind_and_are_not_imported_by_their_old_names():
    moved = moved_table()
    behind = [old for old in moved if (REPO / Path(*old.split("."))).with_suffix(".py").exists()]
    assert not behind, f"files at old paths (the finder aliases them; a file there shadows the moved module): {behind}"
    missing = [new for new in moved.values() if new not in modules()]
    assert not missing, f"agl_core/_moved.py names modules that do not exist: {missing}"
    old_users = [f"{where(name, line)}: {name} imports {target}, now {moved[target]}"
                 for name, path in modules().items() for target, line in imports(name, path, {**modules(), **{
                     old: path for old in moved}}) if target in moved]
    assert not old_users, "imports by an old path:\n" + "\n".join(old_users)


def test_old_paths_give_the_moved_module_with_a_deprecation_warning():
    """In a fresh interpreter: each old name is the new module itself, warned about once; -W error makes it fail."""
    import subprocess
    import sys

    moved = moved_table()
    script = (
        "import importlib, sys, warnings\n"
        f"moved = {moved!r}\n"
        "for old, new in moved.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "        again = importlib.import_module(old)\n"
        "    assert module is again is sys.modules[new], (old, module, sys.modules.get(new))\n"
        "    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
        "    assert len(messages) == 1 and old in messages[0] and new in messages[0], (old, messages)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    old = next(iter(moved))
    strict = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", f"import {old}"],
                            capture_output=True, text=True, cwd=REPO)
    assert strict.returncode != 0 and "DeprecationWarning" in strict.stderr and moved[old] in strict.stderr
    new = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                          "import sys\n" + "".join(f"import {n}\n" for n in moved.values()) +
                          f"assert not set({list(moved)!r}) & set(sys.modules)"], capture_output=True, text=True,
                         cwd=REPO)
    assert new.returncode == 0, new.stderr


def test_hook_context_names_what_train_context_offers():
    """The contract names ``ctx`` by a protocol (so it imports no module above it): it keeps up with TrainContext."""
    import dataclasses

    from agl_core.context import TrainContext
    from agl_core.hookspecs import HookContext

    def public(names):
        return {name for name in names if not name.startswith("_")}

    offered = public({f.name for f in dataclasses.fields(TrainContext)} | set(vars(TrainContext)))
    named = public(set(HookContext.__annotations__) | set(vars(HookContext))) - {"_is_protocol"}
    assert offered == named, f"only TrainContext: {sorted(offered - named)}; only HookContext: {sorted(named - offered)}"
    import inspect

    from agl_core import hookspecs

    hooks = {name: fn for name, fn in vars(hookspecs).items() if hasattr(fn, "agl_kind")}
    other = {name: param.annotation for name, fn in hooks.items()
             for param in inspect.signature(fn).parameters.values() if param.name == "ctx" and
             param.annotation != "HookContext"}
    assert hooks and not other, f"hooks whose ctx is not annotated HookContext: {other}"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
