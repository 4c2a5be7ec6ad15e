"""How a benchmark script hands over its result: the JSON printed, and written to a file when one is given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: Path | None = None, heading: str | None = None) -> None:
    """Prints ``report`` as indented JSON (after ``heading``, when given) and writes the same text to ``out``."""
    text = json.dumps(report, indent=2)
    print(text if heading is None else f"{heading}\n{text}", flush=True)
    if out is not None:
        out.write_text(text + "\n")
