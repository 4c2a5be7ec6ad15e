"""bench.preview_cost's in-process part, dry-run on the tiny model on the CPU: the report it hands the GPU run."""

from __future__ import annotations

import json

import pytest

from bench import preview_cost


def test_tiny_dry_run_times_previews_against_the_render(tmp_path):
    out = tmp_path / "preview_cost.json"
    assert preview_cost.main(["--tiny", "--device", "cpu", "--no-stack", "--points", "128:4", "--repeats", "2",
                              "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    point = report["inprocess"]["points"]["128x128"]
    assert point["image_shape"] == [128, 128, 3]
    assert point["render_ms"] > point["denoise_ms"] > 0
    for fmt in ("png", "jpeg"):
        preview = point["preview"][fmt]
        assert preview["preview_ms"] > 0
        # The report rounds render_ms to 0.1 ms and the share to 5 places, so the share is checked to 1%.
        assert preview["share_of_render"] == pytest.approx(preview["preview_ms"] / point["render_ms"], rel=1e-2)
    assert point["below_5_percent"] == (point["preview"]["png"]["share_of_render"] < 0.05)
    assert "stream" not in report
