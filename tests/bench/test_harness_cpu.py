"""The whole harness on the tiny model on the CPU: services, sweep, in-process baseline, bounds, dashboard.

Checks the shape and sanity of what it writes, never how fast anything was.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench import harness

CONCURRENCY = (1, 2)
REQUESTS = 2
SIZE, STEPS = 128, 2
SERVICE_STAGES = ("ar_prefill_ms", "ar_decode_ms", "ar_tokens", "condition_transfer_ms", "dit_queue_ms", "denoise_ms",
                  "vae_decode_ms", "encode_ms", "total_ms", "transformer_calls", "gateway_ms", "ar_ms_per_token")


@pytest.fixture(scope="module")
def run(tmp_path_factory, without_ardit_env):
    out = tmp_path_factory.mktemp("bench")
    code = harness.main([
        "--out", str(out), "--tiny", "--device", "cpu", "--points", f"{SIZE}:{STEPS}",
        "--concurrency", ",".join(map(str, CONCURRENCY)), "--requests", str(REQUESTS),
        "--inprocess-requests", "1", "--workdir", str(out / "models"),
        "--bounds-copy-mib", "4,16", "--bounds-matmul", "128,256x128x64", "--bounds-windows", "2",
        "--bounds-warm-s", "0", "--bounds-max-warm-s", "0.5",
    ])
    assert code == 0
    return out, json.loads((out / harness.RAW_NAME).read_text())


def test_every_point_is_complete_and_sane(run):
    _, raw = run
    assert raw["model"] == "tiny" and raw["via"] == "rest" and raw["command"].startswith("python -m bench.harness")
    [point] = raw["points"]
    assert (point["size"], point["steps"]) == (SIZE, STEPS)
    assert len(point["warmup"]) == 1
    assert [r["concurrency"] for r in point["runs"]] == list(CONCURRENCY)
    for r in point["runs"]:
        assert r["completed"] == REQUESTS and r["failed"] == 0, r.get("errors")
        lat = r["latency_s"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert lat["min"] <= lat["mean"] <= lat["max"]
        assert r["throughput_images_per_s"] > 0
        for stage in SERVICE_STAGES:
            assert stage in r["stages_ms"], stage
            assert r["stages_ms"][stage] >= 0
        assert r["stages_ms"]["ar_tokens"] == (SIZE // 16) * (SIZE // 16 + 1) + 1  # the grid contract
        assert r["stages_ms"]["ar_ms_per_token"] > 0 and r["stages_ms"]["denoise_ms"] > 0
        assert len(r["samples"]) == REQUESTS
        assert r["engines"]["ar"]["largest_batch"] >= 1 and r["engines"]["dit"]["largest_batch"] >= 1
        assert r["engine_counts"]["ar"]["completed_total"] == REQUESTS
        assert r["peak_gpu_mib"] is None  # no nvidia-smi numbers on the CPU
    seeds = [s["seed"] for r in point["runs"] for s in r["samples"]]
    assert len(set(seeds)) == len(seeds)


def test_in_process_baseline_ran_with_the_same_stage_names(run):
    _, raw = run
    [point] = raw["inprocess"]["points"]
    assert (point["size"], point["steps"]) == (SIZE, STEPS)
    assert point["latency_s_mean"] > 0
    service_stages = raw["points"][0]["runs"][0]["stages_ms"]
    for stage, value in point["stages_mean"].items():
        assert stage in service_stages and value >= 0
    assert point["stages_mean"]["ar_tokens"] == service_stages["ar_tokens"]
    assert point["stages_mean"]["transformer_calls"] == service_stages["transformer_calls"]
    [overhead] = raw["transport_overhead"]
    assert overhead["size"] == SIZE and overhead["service_c1_mean_s"] > 0


def test_bounds_were_measured_and_set_against_the_stages(run):
    _, raw = run
    bounds = raw["bounds"]
    measured = bounds["measured"]
    assert measured["copy"]["gb_per_s"] > 0 and measured["matmul"]["tflop_per_s"] > 0
    assert [size["bytes"] for size in measured["copy"]["sizes"]] == [4 * 2**20, 16 * 2**20]
    assert [size["shape"] for size in measured["matmul"]["sizes"]] == [[128, 128, 128], [256, 128, 64]]
    assert measured["matmul"]["dtype"] == "float32"  # the services' dtype on a CPU
    assert measured["datasheet"] is None and measured["gpu_idle"] is None  # a CPU: no datasheet, no nvidia-smi
    assert bounds["decode_weight_bytes"] > 0 and bounds["dtype_bytes"] == 4
    [row] = bounds["per_size"]
    assert row["ar_bound_ms_per_token"] > 0 and row["dit_flops"]["flops"] > 0
    assert row["dit_flops"]["transformer_calls"] == raw["points"][0]["runs"][0]["stages_ms"]["transformer_calls"]
    for label in ("service", "inprocess"):
        assert row[f"{label}_ar_ratio_to_bound"] > 0 and row[f"{label}_dit_fraction_of_matmul"] > 0


def test_dashboard_has_the_tables_and_the_targets(run):
    out, raw = run
    text = (out / "DASHBOARD.md").read_text()
    assert raw["command"] in text and raw["date"] in text
    for heading in ("## Targets", "## Sweep", "## Stage breakdown", "## Transport overhead", "## Physical bounds"):
        assert heading in text
    assert "| target | measured | verdict |" in text
    for target in ("AR ms/token within 1.3x of bound", "DiT >= 60% of measured matmul rate", "transport overhead <= 2% at 512",
                   "1024/50 steps c1 mean latency <= 25 s", "512/20 steps c1 mean latency <= 6 s",
                   "c4 throughput >= 3.5x c1 at 512/20"):
        assert target in text, target
    assert "Ratios to bounds are taken against the measured copy bandwidth" in text
    assert "measured in this run" in text and "No datasheet figure is known for this device" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "dashboard.png").stat().st_size > 0
    else:
        assert "skipped" in text and not (out / "dashboard.png").exists()
