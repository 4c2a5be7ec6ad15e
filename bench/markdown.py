"""What the bench reports share to write markdown: cell formatting, tables, verdicts, and looking up a run or a
nested value in a report. bench.dashboard, bench.saturation_report and bench.beyond_bf16 take these from here and
from nowhere else, so that none of them imports another's internals (and no two import each other)."""

from __future__ import annotations

from typing import Any


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: "-" for nothing, floats to ``digits`` places, anything else as text."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table's lines, each cell through ``fmt``."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def verdict(value: Any, ok: bool) -> str:
    """A target's verdict: "pass", "FAIL", or "n/a (not measured)" when there is no value."""
    if value is None:
        return "n/a (not measured)"
    return "pass" if ok else "FAIL"


def find_run(raw: dict, size: int, steps: int, concurrency: int) -> dict | None:
    """The run at ``size``/``steps`` and ``concurrency`` of a bench.run report that measured a latency, if any."""
    for point in raw.get("points", []):
        if point["size"] == size and point["steps"] == steps:
            for run in point["runs"]:
                if run["concurrency"] == concurrency and run.get("latency_s"):
                    return run
    return None


def lookup(report: dict, *path: str, default: Any = None) -> Any:
    """``report[path[0]][path[1]]...``, or ``default`` where a key is missing or a node is not a mapping."""
    node: Any = report
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node
