"""The package's layers: no module of ``vkv`` needs, even through a chain, a module that needs it.

The layers are server -> engine -> (scheduler, block managers, model runner) -> models, kernels,
and nothing below may need what is above it. Every import counts: at the top of a module, inside
a function (an import moved into a function to dodge a circle is still a circle) and under
``TYPE_CHECKING``.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vkv"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of ``vkv`` -> the modules of ``vkv`` it imports, wherever the import is."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [t if t in modules else node.module for t in targets]
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path around each strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for neighbour in sorted(graph[node]):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_vkv_is_part_of_an_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (each group imports itself through the others): " + "; ".join(
        " <-> ".join(group) for group in found
    )


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_the_circle_finder_finds_circles_and_only_circles(graph, expected):
    assert circles(graph) == expected
