"""bench/fp8_check on the tiny model (CPU): its fidelity parts run, a failing part is recorded, the page's verdicts."""

from __future__ import annotations

import json
import math

from bench import fp8_check


def test_the_tiny_run_measures_every_fidelity_part_and_writes_both_files(tmp_path, monkeypatch):
    def broken(self):
        raise RuntimeError("made to fail")

    monkeypatch.setattr(fp8_check.DiTBench, "layers", broken)  # one part fails; the others still run
    out = tmp_path / "fp8.json"
    assert fp8_check.main(["--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dit_layers"]["error"] == "RuntimeError: made to fail"
    failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    assert failed == ["dit_layers"]
    roles = report["ar_layers"]["by_role"]
    assert {"gen_head", "layers:self_attn.q_proj", "layers:mlp.down_proj"} <= set(roles)
    assert all(0 < v["mean"] <= v["max"] < 0.1 for v in roles.values())
    velocity = report["dit_velocity"]
    assert 0 < velocity["rel_err_bf16_vs_fp32"] and 0 < velocity["rel_err_fp8_vs_bf16"] < 0.5
    assert 0 < report["ar_prefill"]["hidden_rel_err"] < 0.1
    assert 20 < report["image"]["psnr_db"] < math.inf
    assert "skipped" in report["ar_decode"] and "skipped" in report["dit_step"]
    page = (tmp_path / "fp8.md").read_text()
    assert "image PSNR bf16 vs fp8, 128x128" in page and "dit_layers: RuntimeError: made to fail" in page


def test_the_page_marks_each_target_pass_or_fail():
    report = {
        "ar_decode": {"positions": [700, 2200], "bf16": {"ms_per_token": {"700": 3.9, "2200": 4.1}},
                      "fp8": {"ms_per_token": {"700": 2.0, "2200": 2.3}}},
        "dit_step": {"bf16": {"ms": {"512": 30.0, "1024": 120.0}}, "fp8": {"ms": {"512": 25.0, "1024": 70.0}}},
    }
    rows = [line for line in fp8_check.markdown(report).splitlines() if line.startswith("| AR decode") or "DiT" in line]
    assert rows[0].endswith("| <= 2.1 | pass |") and rows[1].endswith("| <= 2.1 | fail |")
    assert "1.71x faster | >= 1.5x | pass |" in rows[3]
    assert rows[2].endswith("| - | - |")  # 512 has no target
