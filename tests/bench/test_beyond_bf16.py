"""The dashboard's FP8 and saturation section: every target of the work past bf16 in one table, each from the
benchmark that measures it, marked pass, FAIL or "not measured"."""

from __future__ import annotations

import json

from bench import beyond_bf16, dashboard


def _checks() -> list[dict]:
    """An AR-only and a DiT-only bench.fp8_check report, as --parts ar / --parts dit write them."""
    ar = {"device": "NVIDIA H200", "ar_decode": {"positions": [700, 2200], "bf16": {"ms_per_token": {"700": 3.9}},
                                                "fp8": {"ms_per_token": {"700": 1.95, "2200": 2.3}}}}
    dit = {"device": "NVIDIA H200", "dit_step": {"bf16": {"ms": {"512": 17.0, "1024": 70.0}},
                                                 "fp8": {"ms": {"512": 20.0, "1024": 45.0}}}}
    return [ar, dit]


def _fp8_run() -> dict:
    """A harness run with FP8 model services: 1024x1024/50 at c1 only."""
    run = {"concurrency": 1, "latency_s": {"mean": 13.5}}
    return {"command": "python -m bench.harness --extra-ar=--quantization=fp8", "points": [
        {"size": 1024, "steps": 50, "runs": [run]}]}


def _saturation(precision: str, images_per_s: float) -> dict:
    point = {"size": 512, "steps": 20, "clients": 16, "throughput_images_per_s": images_per_s, "completed": 80,
             "failed": 0, "window_s": 50.0, "latency_s": {"mean": 10.0, "p50": 10.0, "p95": 11.0, "p99": 11.5}}
    return {"precision": precision, "points": [point]}


def _verdicts(lines: list[str]) -> dict[str, str]:
    """target -> verdict, from the section's targets table."""
    start = lines.index("| target | measured | verdict |") + 2
    end = lines.index("", start)
    return {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").rsplit(" | ", 1)[1] for line in lines[start:end]}


def test_each_target_is_judged_from_the_benchmark_that_measures_it():
    lines = beyond_bf16.section(_checks(), _fp8_run(), [_saturation("bf16", 1.62)])
    verdicts = _verdicts(lines)
    assert verdicts["AR ms/token at c1, FP8 <= 2.1 ms"] == "pass"  # the check's 1.95 ms: the run has no AR timings
    assert verdicts["DiT 1024x1024 guided denoise step, FP8 >= 1.5x faster than bf16"] == "pass"  # 70 / 45 = 1.56x
    assert verdicts["1024x1024/50 c1 mean latency, FP8 <= 12 s"] == "FAIL"
    assert verdicts["512x512/20 c1 mean latency, FP8 <= 2.8 s"] == "not measured"
    assert any(v == "pass" for k, v in verdicts.items() if "c16 steady throughput, bf16" in k)
    assert any(v == "not measured" for k, v in verdicts.items() if "c16 steady throughput, fp8" in k)
    text = "\n".join(lines)
    assert "1.95 ms, decode step at 1 row @ 700 positions (bf16 3.90 ms)" in text
    assert "1.56x (45.0 against 70.0 ms)" in text
    assert "13.50 s" in text


def test_the_ar_time_per_token_of_the_fp8_services_run_is_preferred_to_the_decode_step_alone():
    """The target is the services' time per token at one request: the run's own stage timings, its slowest size."""
    run = _fp8_run()
    run["points"][0]["runs"][0]["stages_ms"] = {"ar_ms_per_token": 3.83}
    run["points"].append({"size": 512, "steps": 20, "runs": [
        {"concurrency": 1, "latency_s": {"mean": 4.87}, "stages_ms": {"ar_ms_per_token": 3.8}}]})
    lines = beyond_bf16.section(_checks(), run, [])
    assert _verdicts(lines)["AR ms/token at c1, FP8 <= 2.1 ms"] == "FAIL"  # not the check's 1.95 ms
    assert "3.83 ms in the FP8 services (1024/50: 3.83, 512/20: 3.80)" in "\n".join(lines)


def test_a_slower_fp8_step_fails_and_absent_benchmarks_are_not_measured():
    ar, dit = _checks()
    dit["dit_step"]["fp8"]["ms"]["1024"] = 81.5  # slower than bf16
    verdicts = _verdicts(beyond_bf16.section([ar, dit], None, []))
    assert verdicts["DiT 1024x1024 guided denoise step, FP8 >= 1.5x faster than bf16"] == "FAIL"
    assert verdicts["1024x1024/50 c1 mean latency, FP8 <= 12 s"] == "not measured"
    assert all(v == "not measured" for k, v in verdicts.items() if "steady throughput" in k)
    verdicts = _verdicts(beyond_bf16.section([], None, []))
    assert set(verdicts.values()) == {"not measured"} and len(verdicts) == 6


def test_the_dashboard_command_adds_the_section_after_the_run_targets(tmp_path):
    raw = {"model": "tiny", "machine": {"cpus": 2}, "points": [], "via": "rest"}
    paths = {}
    for name, report in {"raw": raw, "ar": _checks()[0], "dit": _checks()[1], "fp8run": _fp8_run(),
                         "sat": _saturation("fp8", 2.6)}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(report))
    out = tmp_path / "dash"
    assert dashboard.main([str(paths["raw"]), "--out", str(out), "--fp8", str(paths["ar"]), str(paths["dit"]),
                           "--fp8-run", str(paths["fp8run"]), "--saturation", str(paths["sat"])]) == 0
    page = (out / dashboard.MARKDOWN_NAME).read_text()
    assert page.index("## Targets") < page.index("## Past the bf16 limit: FP8 and saturation") < page.index("## Sweep")
    assert "| 512x512/20, c16 steady throughput, fp8 >= 2.5 img/s | 2.600 img/s" in page
    plain = tmp_path / "plain"
    dashboard.main([str(paths["raw"]), "--out", str(plain)])
    assert "Past the bf16 limit" not in (plain / dashboard.MARKDOWN_NAME).read_text()
