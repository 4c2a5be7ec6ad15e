"""bench.prefill_parts on the tiny model on the CPU: every part is reported for the prompt it names, both ways
(fresh and as a memo hit), and FP8 says why it was skipped. Checks what it writes, never how fast."""

from __future__ import annotations

import json

from ar_service.decoding.stream import UNCOND_PROMPT_TOKENS
from bench import prefill_parts


def test_the_report_has_every_part_fresh_and_kept(tmp_path):
    out = tmp_path / "prefill.json"
    assert prefill_parts.main(["--tiny", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["size"] == prefill_parts.SIZE
    parts = report["float32"]
    assert parts["prompt_tokens"] > parts["prefix_tokens"] > 0 and parts["negative_tokens"] > 0
    assert parts["unconditional_tokens"] == UNCOND_PROMPT_TOKENS
    for name in ("negative", "unconditional_row", "stream", "per_image"):
        assert parts[f"{name}_ms"] > 0 and parts[f"{name}_memo_hit_ms"] >= 0
    assert parts["per_image_ms"] == round(parts["negative_ms"] + parts["stream_ms"], 3)
    assert "CUDA" in report["fp8"]["skipped"]
