"""ar_service's modules import each other without a circle: each one can be read, and imported, after the ones it
names. Every import counts, at any depth (a function's own import too), and importing ``a.b.c`` runs ``a.b`` too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it makes Python run (itself excluded), for every ``.py`` under ``package``."""
    base = root / package
    names = {}
    for path in base.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def runs(module: str) -> set[str]:
        """``module`` and the packages above it (an import runs their ``__init__`` first)."""
        parts = module.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & names.keys()

    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        edges: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges |= runs(alias.name)
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:  # relative: from the module's own package
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    target = ".".join([*anchor, *([target] if target else [])])
                edges |= runs(target)
                edges |= {m for alias in node.names if (m := f"{target}.{alias.name}") in names}  # submodules
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each as the path that closes it (depth-first from each module)."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                found.append(path[path.index(target):] + [target])
            elif target not in done:
                walk(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        walk(module, [module])
    return found


def test_ar_service_imports_without_a_circle():
    graph = module_graph(ROOT, "ar_service")
    assert {"ar_service.decoding.stream", "ar_service.decoding.decoders", "ar_service.conditions"} <= graph.keys()
    assert "ar_service.decoding.modes" in graph["ar_service.decoding.stream"]
    assert cycles(graph) == []


def test_the_check_finds_a_circle_through_a_package_and_a_lazy_import(tmp_path):
    """The circle ar_service had: the modes imported the stream, which imports the modes; here one import sits in a
    function and one goes through the package's ``__init__``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.modes import Mode\n")
    (pkg / "sub" / "modes.py").write_text("class Mode:\n    def start(self):\n        from pkg.stream import Stream\n")
    (pkg / "stream.py").write_text("from pkg.sub import modes\n")
    found = cycles(module_graph(tmp_path, "pkg"))
    assert found and all(path[0] == path[-1] for path in found)
    assert any({"pkg.stream", "pkg.sub.modes"} <= set(path) for path in found)
