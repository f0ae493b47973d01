"""The package's rooms and the imports between them: every import of a module of pyinfer/ (at the top of a
file or inside a function, and module paths named in strings, which importlib dispatch reads) is mapped to its
room; a room may import itself and the rooms below it, never one above or beside it, so no circle of imports
crosses rooms. Prints the room graph, the circles inside a room, and any import that breaks the order; exits 1
if there is one.

    python -m tools.import_graph [--modules]
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pyinfer"
# low -> high: a room imports only rooms of a lower rank (and itself). The root's own modules (errors, argument
# checks, console failures) are the base every room shares; pyinfer/__init__.py is the front door (pyinfer.Model)
# and __main__.py the `python -m pyinfer` door: both sit above everything.
RANKS = {"base": 0, "formats": 1, "native": 1, "models": 2, "converters": 2, "hub": 3, "engine": 4, "sparsity": 5,
         "apps": 6, "door": 7}


def module_name(path: Path, root: Path) -> str:
    """root/pyinfer/engine/driver.py -> pyinfer.engine.driver; a package's __init__.py -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str, package: Path = PACKAGE) -> str:
    """pyinfer.engine.driver -> engine; pyinfer.errors -> base; pyinfer, pyinfer.__main__ -> door; tools.* -> tools."""
    parts = module.split(".")
    if parts[0] != "pyinfer":
        return parts[0]
    if module in ("pyinfer", "pyinfer.__main__"):
        return "door"
    if parts[1] == "_pyinfer_native":  # the compiled module the binding loads
        return "native"
    return parts[1] if (package / parts[1]).is_dir() else "base"


def modules(folder: Path) -> dict[str, Path]:
    """Module name -> file, for every module under folder (a package of the repository's root)."""
    return {module_name(p, folder.parent): p for p in sorted(folder.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of the package that the file at path imports, or names in a string, as full names."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    found = set()

    def add(target: str) -> None:
        while target and target not in known and target.split(".")[-1] != "_pyinfer_native":
            target = target.rsplit(".", 1)[0] if "." in target else ""
        if target:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from pyinfer.native import ggml` imports the module pyinfer.native.ggml
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            if node.value in known:  # importlib.import_module("pyinfer.sparsity.profiler")
                found.add(node.value)
    # `from pyinfer import __version__` reads the front door's attribute; the door imports nothing at load time
    return found - {name, "pyinfer"}


def edges(package: Path = PACKAGE) -> list[tuple[str, str]]:
    """(importer, imported) for every import between modules of the package, and of tools/ from it."""
    mods = modules(package)
    known = set(mods) | set(modules(package.parent / "tools"))
    return sorted((name, target) for name, path in mods.items() for target in imported(path, name, known))


def circles(pairs: list[tuple[str, str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of two or more modules (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def violations(package: Path = PACKAGE) -> list[str]:
    """Imports that break the order of RANKS, imports of tools/, and rooms RANKS does not place."""
    bad = []
    for name in modules(package):
        if room(name, package) not in RANKS:
            bad.append(f"{name}: room {room(name, package)!r} has no place in RANKS")
    for a, b in edges(package):
        ra, rb = room(a, package), room(b, package)
        if rb == "tools":
            bad.append(f"{a} imports {b}: the package never imports the developer tools")
        elif ra in RANKS and rb in RANKS and ra != rb and RANKS[rb] >= RANKS[ra]:
            bad.append(f"{a} ({ra}) imports {b} ({rb}): not a lower room")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.import_graph", description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", action="store_true", help="list every import between modules, not only rooms")
    args = p.parse_args(argv)
    pairs = edges()
    by_room: dict[str, set[str]] = {}
    for a, b in pairs:
        if room(a) != room(b):
            by_room.setdefault(room(a), set()).add(room(b))
    for r in sorted(RANKS, key=RANKS.get):
        below = sorted(by_room.get(r, ()), key=lambda x: RANKS.get(x, len(RANKS)))
        print(f"{r:10} (rank {RANKS[r]}) imports {', '.join(below) or 'nothing of the package'}")
    for members in circles(pairs):
        print(f"circle inside {', '.join(sorted({room(m) for m in members}))}: {' <-> '.join(members)}")
    if args.modules:
        for a, b in pairs:
            print(f"  {a} -> {b}")
    bad = violations()
    for line in bad:
        print(f"violation: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
