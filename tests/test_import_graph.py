"""fulmen's modules import each other without cycles, counting every import a module makes: at module level, inside
functions and under `if TYPE_CHECKING:`. A cycle hidden in a function or behind TYPE_CHECKING still ties the modules
together (neither can move or be read alone), and it is how an import-time cycle starts (issue 46).

Edges: `import fulmen.a.b` and `from fulmen.a import b`, where `b` is a submodule, go to `fulmen.a.b`; `from fulmen.a
import name` goes to `fulmen.a` (its `__init__`). Relative imports are resolved. The implicit edge from a submodule
to its parent package (importing `fulmen.a.b` runs `fulmen/a/__init__.py` first) is not counted: every package whose
`__init__` re-exports its children would be a cycle with them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mapped_folders() -> dict[str, str]:
    """The top-level folders installed as fulmen subpackages (setup.py's MAPPED), e.g. fulmen.unsloth -> unsloth."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MAPPED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no MAPPED")


def modules_under(folder: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for the package `package` whose files are under `folder`."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def _enclosing(name: str, modules: dict[str, Path]) -> str | None:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def import_graph(modules: dict[str, Path], root_package: str) -> dict[str, dict[str, list[int]]]:
    """Module -> imported module -> the lines importing it, over every import statement in the module's file."""
    graph: dict[str, dict[str, list[int]]] = {}
    for module, path in modules.items():
        edges: dict[str, list[int]] = {}
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] != root_package:
                    continue
                resolved = _enclosing(target, modules)
                if resolved is not None and resolved != module:
                    edges.setdefault(resolved, []).append(node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, {}):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(graph, set(component), component[0]) for component in components]


def _cycle_in(graph: dict[str, dict[str, list[int]]], component: set[str], start: str) -> list[str]:
    """A path from `start` back to itself within `component` (breadth-first: a shortest one)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor not in component:
                    continue
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected component without a cycle through it")


def describe(graph: dict[str, dict[str, list[int]]], cycle: list[str]) -> str:
    hops = [f"{a} (line {', '.join(map(str, graph[a][b]))})" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
    return " -> ".join([*hops, cycle[0]])


def fulmen_modules() -> dict[str, Path]:
    modules = modules_under(ROOT / "fulmen", "fulmen")
    for package, folder in _mapped_folders().items():
        modules.update(modules_under(ROOT / folder, package))
    return modules


def test_fulmen_has_no_import_cycle():
    modules = fulmen_modules()
    assert {"fulmen.core.trace", "fulmen.core.codegen", "fulmen.distributed.specs", "fulmen.unsloth"} <= set(modules)
    graph = import_graph(modules, "fulmen")
    found = [describe(graph, cycle) for cycle in cycles(graph)]
    assert not found, "import cycles (module-level, function-level or TYPE_CHECKING imports):\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_graph_counts_function_level_type_checking_and_submodule_imports(tmp_path):
    """The checker itself: each kind of import closes a cycle it reports; a parent package re-exporting its
    children is no cycle."""
    _write(tmp_path / "pkg", {
        "__init__.py": "from pkg.sub import a, b\n",
        "sub/__init__.py": "from pkg.sub.a import f\n",
        "sub/a.py": "from pkg.sub import b\n\ndef f():\n    pass\n",
        "sub/b.py": "def g():\n    from pkg.sub.c import h\n",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "leaf.py": "import pkg.sub.a\nfrom pkg import sub\n",
    })
    graph = import_graph(modules_under(tmp_path / "pkg", "pkg"), "pkg")
    assert graph["pkg.sub.a"] == {"pkg.sub.b": [1]}  # `from pkg.sub import b`: the submodule, not the package
    assert graph["pkg.sub.b"] == {"pkg.sub.c": [2]}  # inside a function
    assert graph["pkg.sub.c"] == {"pkg.sub.a": [3]}  # under TYPE_CHECKING, relative
    assert graph["pkg.leaf"] == {"pkg.sub.a": [1], "pkg.sub": [2]}
    found = cycles(graph)
    assert found == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.c"]]
    assert describe(graph, found[0]) == ("pkg.sub.a (line 1) -> pkg.sub.b (line 2) -> pkg.sub.c (line 3) -> "
                                         "pkg.sub.a")
