"""How deep the library's import graph is and which arrows point up: the figures of the layout review.

    python benchmarks/import_graph.py [--dot PATH]

Reads every module of the library (paxserve, models, pallas_kernels, server; after the namespaced
install, all under paxserve) with `ast`, so nothing is imported. An arrow is any import of another
library module, at the top of a file or inside a function. Level: a module that imports no library
module is level 1, any other is one more than the deepest module it imports (arrows inside a cycle
are counted once, and the cycle is reported). Rooms are ranked by DESIGN.md's order (server above
the engine above distributed above worker above core; worker above models above kernels); an arrow
from a room to one ranked above it is a back-arrow.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("paxserve", "models", "pallas_kernels", "server")
# Installed import names -> folders in the checkout (the namespaced install maps these).
ALIASES = {"paxserve.models": "models", "paxserve.server": "server", "paxserve.kernels": "pallas_kernels"}
# Higher rank = higher in the house; an import must go to an equal or lower rank (longest prefix wins;
# the flat paxserve/ of before the rooms ranks as the engine).
RANKS = {"server": 6, "paxserve": 5, "paxserve.engine": 5, "paxserve.distributed": 4, "paxserve.worker": 3,
         "paxserve.core": 1, "models": 2, "pallas_kernels": 1,
         # Settings and plain values every room may import.
         "paxserve.config": 0, "paxserve.sampling_params": 0, "paxserve.structured_outputs": 0,
         "paxserve.outputs": 0}


def modules() -> dict[str, Path]:
    """Every library module by its folder-dotted name (`models.decoder`, `paxserve.core.scheduler`)."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _folder_name(name: str) -> str:
    for alias, folder in ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            return folder + name[len(alias):]
    return name


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in names:
            target = _folder_name(target)
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    # `from x import y` also names x when y is a submodule; keep the deepest only.
    return {t for t in targets if not any(o.startswith(t + ".") for o in targets)}


def rank(name: str) -> int | None:
    best = None
    for prefix, value in RANKS.items():
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
            best = (len(prefix), value)
    return None if best is None else best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dot", type=Path, help="also write the graph in Graphviz dot")
    args = parser.parse_args()
    found = modules()
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    level, cycles = _level_of(graph)
    arrows = sum(len(t) for t in graph.values())
    back = [(a, b) for a, targets in graph.items() for b in sorted(targets)
            if rank(a) is not None and rank(b) is not None and rank(b) > rank(a)]
    _report(found, graph, level, cycles, arrows, back)
    if args.dot:
        args.dot.write_text("digraph imports {\n" + "".join(f'  "{a}" -> "{b}";\n' for a, t in graph.items()
                                                           for b in sorted(t)) + "}\n")


def _levels(graph: dict[str, set[str]]) -> int:
    return max(_level_of(graph)[0].values(), default=0)


def _level_of(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[list[str]]]:
    level: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, stack: list[str]) -> int:
        if name in level:
            return level[name]
        if name in stack:
            cycles.append(stack[stack.index(name):] + [name])
            return 0
        stack.append(name)
        deepest = max((visit(t, stack) for t in sorted(graph[name])), default=0)
        stack.pop()
        level[name] = deepest + 1
        return level[name]

    for name in graph:
        visit(name, [])
    return level, cycles


def _report(found: dict[str, Path], graph: dict[str, set[str]], level: dict[str, int],
            cycles: list[list[str]], arrows: int, back: list[tuple[str, str]]) -> None:
    for top in FOLDERS:
        inside = [n for n in found if n == top or n.startswith(top + ".")]
        lines = sum(len(found[n].read_text().splitlines()) for n in inside)
        within = sum(len([t for t in graph[n] if t in inside]) for n in inside)
        print(f"{top}/: {len(inside)} modules, {lines} lines, {within} arrows within, "
              f"{_levels({n: {t for t in graph[n] if t in inside} for n in inside})} levels within")
    print(f"{len(found)} modules, {arrows} arrows, {max(level.values())} levels")
    deepest = max(level, key=level.get)
    chain = [deepest]
    while graph[chain[-1]] - set(chain):
        chain.append(max(sorted(graph[chain[-1]] - set(chain)), key=lambda t: level.get(t, 0)))
    print("deepest chain: " + " -> ".join(chain))
    print(f"{len(back)} back-arrows" + "".join(f"\n  {a} -> {b}" for a, b in back))
    for cycle in cycles:
        print("cycle: " + " -> ".join(cycle))


if __name__ == "__main__":
    sys.exit(main())
