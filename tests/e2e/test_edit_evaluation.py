"""``python -m train.evaluate --edits`` against the real services on the tiny Dev model: held-out edits go to
``/v1/images/edits`` as multipart and come back scored per kind. The tiny model has random weights, so this checks
the report's shape and counts, not accuracy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.e2e.conftest import Stack
from tests.e2e.test_edits import dev_stack  # noqa: F401  (the fixture)
from train.edits import EDIT_KINDS, held_out_edit_examples
from train.evaluate import main


def edits_answered(stack: Stack) -> float:
    text = httpx.get(f"{stack.gateway_url}/metrics", timeout=10).text
    found = re.search(r'ardit_gateway_requests_total\{route="/v1/images/edits",status="200"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_the_edits_evaluator_reports_every_kind_through_the_edits_route(dev_stack: Stack, tmp_path: Path,  # noqa: F811
                                                                       capsys) -> None:
    before = edits_answered(dev_stack)
    out = tmp_path / "edits.json"
    assert main(["--url", dev_stack.gateway_url, "--edits", "-n", "4", "--steps", "2", "--knob",
                 "image_guidance_scale=1.5", "--json", str(out)]) == 0
    assert edits_answered(dev_stack) - before == 4

    report = json.loads(out.read_text())
    assert report["count"] == 4 and report["knobs"] == {"num_inference_steps": 2, "image_guidance_scale": 1.5}
    assert list(report["rates"]) == [*EDIT_KINDS, "overall"]
    for group, rates in report["rates"].items():
        assert rates["count"] == (4 if group == "overall" else 1)
        assert set(rates) == {"count", "changed", "kept", "all"} and all(0 <= rates[s] <= 1 for s in ("changed", "kept", "all"))
    asked = held_out_edit_examples(4)
    assert [(i["kind"], i["caption"], i["seed"]) for i in report["images"]] == [
        (x.edit.kind, x.instruction, s) for s, x in enumerate(asked)]
    assert all(i["size"] == "128x128" and len(i["digest"]) == 64 for i in report["images"])
    assert all(set(i["found"]) == {"background", "shape", "colour", "position"} for i in report["images"])

    printed = capsys.readouterr().out
    assert "4 held-out edits through" in printed
    tables = printed.split("\n\n")  # the edit kinds, then each attribute read as the target's, then the outlines
    kinds = [line.split("|")[1].strip() for line in tables[1].splitlines()[2:]]
    assert kinds == [*EDIT_KINDS, "overall"]
    attributes = [line.split("|")[1].strip() for line in tables[2].splitlines()[2:]]
    assert attributes == ["background", "shape", "colour", "position", "all four (fully correct)"]
