"""The bench reports share their markdown helpers through bench.markdown: no report imports another's privates, and
the bench modules' imports form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
REPORTS = ("dashboard", "beyond_bf16", "saturation_report")


def _imports() -> dict[str, list[tuple[str, str]]]:
    """module -> [(imported bench module, name)] for every ``from bench[.x] import y`` at any depth."""
    modules = {path.stem for path in BENCH.glob("*.py")}
    found: dict[str, list[tuple[str, str]]] = {}
    for path in BENCH.glob("*.py"):
        edges = found.setdefault(path.stem, [])
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module == "bench":
                edges += [(alias.name, "") for alias in node.names if alias.name in modules]
            elif node.module.startswith("bench."):
                edges += [(node.module.split(".")[1], alias.name) for alias in node.names]
    return found


def test_the_reports_import_no_private_name_of_another_bench_module():
    imports = _imports()
    private = [(report, module, name) for report in REPORTS for module, name in imports[report] if name.startswith("_")]
    assert private == []


def test_the_bench_modules_import_each_other_without_a_cycle():
    graph = {module: {target for target, _ in edges} for module, edges in _imports().items()}
    cycles = []

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            else:
                walk(target, path + [target])

    for report in REPORTS:
        walk(report, [report])
    assert cycles == []
