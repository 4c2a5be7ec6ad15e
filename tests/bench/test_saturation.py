"""The saturation benchmark on the tiny model on the CPU: closed-loop clients, warm-up, measured window, abandoned
requests cancelled, engine histograms read, the report's targets. Checks what it writes, never how fast."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bench import saturation, saturation_report
from bench.harness import Outcome

SIZE, STEPS, CLIENTS = 64, 2, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory, without_ardit_env):
    out = tmp_path_factory.mktemp("saturation")
    code = saturation.main([
        "--out", str(out), "--tiny", "--device", "cpu", "--points", f"{SIZE}:{STEPS}:{CLIENTS}",
        "--warmup-s", "0.5", "--window-s", "2", "--window-latencies", "0", "--workdir", str(out / "models"),
        "--service-arg", "--log-level=info", "--dit-arg", "--batch-window-s", "--dit-arg=0.05",
    ])
    assert code == 0
    return out, json.loads((out / saturation.RESULT_NAME).read_text())


def test_a_closed_loop_point_measures_a_window_of_completed_requests(run):
    _, result = run
    assert result["model"] == "tiny" and result["precision"] == "fp32"
    [point] = result["points"]
    assert (point["size"], point["steps"], point["clients"]) == (SIZE, STEPS, CLIENTS)
    assert point["failed"] == 0 and point["failed_in_warmup"] == 0, point["errors"]
    assert point["completed"] > 0 and point["throughput_images_per_s"] > 0
    assert point["window_s"] >= 2 and point["warmup_s"] >= 0.5
    assert sum(s["in_window"] for s in point["samples"]) == point["completed"]
    lat = point["latency_s"]
    assert 0 < lat["min"] <= lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert point["stages_ms"]["ar_tokens"] == (SIZE // 16) * (SIZE // 16 + 1) + 1  # the grid contract
    assert point["stages_ms"]["denoise_ms"] > 0
    # every client got answers; the requests in flight when the window closed were abandoned and left the engines
    assert point["requests_sent"] >= CLIENTS + point["completed"]
    assert point["idle_after"]
    batching = point["batching"]
    assert batching["ar"]["steps"] > 0 and batching["ar"]["streams_per_step"] >= 1
    assert batching["dit"]["steps"] > 0 and 1 <= batching["dit"]["images_per_step"] <= CLIENTS


def test_service_flags_pass_through_after_the_saturation_settings(run):
    _, result = run
    ar, dit = result["service_args"]["ar_service"], result["service_args"]["dit_service"]
    assert ar[: len(saturation.SATURATION_AR_ARGS)] == saturation.SATURATION_AR_ARGS
    assert dit[: len(saturation.SATURATION_DIT_ARGS)] == saturation.SATURATION_DIT_ARGS
    assert "--log-level=info" in ar and "--log-level=info" in dit
    assert dit[-2:] == ["--batch-window-s", "0.05"] and "--batch-window-s" not in ar
    assert result["points"][0]["engines"]["dit"]["max_batch_size"] == 8  # the settings reached the service


def test_the_report_lists_the_point_and_leaves_unmeasured_targets_open(run):
    out, _ = run
    text = (out / saturation.MARKDOWN_NAME).read_text()
    assert f"| fp32 | {SIZE}x{SIZE}/{STEPS}, c{CLIENTS} |" in text
    assert "| fp8 | 512x512/20, c16 | not measured |" in text
    assert text.count("| not measured | not measured |") == 2  # both throughput targets


def _result(precision: str, images_per_s: float) -> dict:
    point = {"size": 512, "steps": 20, "clients": 16, "throughput_images_per_s": images_per_s, "completed": 90,
             "failed": 0, "window_s": 60.0, "latency_s": {"mean": 9.0, "p50": 8.9, "p95": 11.0, "p99": 12.0}}
    return {"precision": precision, "points": [point]}


def test_targets_pass_or_fail_against_the_issue_thresholds():
    text = saturation_report.render([_result("bf16", 1.62), _result("fp8", 2.1)])
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if "steady throughput" in line}
    bf16 = next(line for key, line in rows.items() if "bf16 >= 1.5" in key)
    fp8 = next(line for key, line in rows.items() if "fp8 >= 2.5" in key)
    assert bf16.endswith("| pass |") and "p95 11.00 s" in bf16
    assert fp8.endswith("| FAIL |")
    later = saturation_report.render([_result("bf16", 1.62), _result("bf16", 1.2)])  # a later file's row wins
    assert "1.200 img/s" in later and "| FAIL |" in later


def test_the_points_table_gives_littles_law_beside_the_window_count():
    text = saturation_report.render([_result("bf16", 1.62)])
    row = next(line for line in text.splitlines() if line.startswith("| bf16 | 512x512/20, c16 | 1.62"))
    assert row.split(" | ")[3] == "1.778"  # 16 clients / 9.0 s mean latency


def test_pass_through_flags_may_start_with_a_dash():
    argv = saturation.join_pass_through(["--out", "x", "--service-arg", "--quantization=fp8", "--ar-arg", "--x"])
    assert argv == ["--out", "x", "--service-arg=--quantization=fp8", "--ar-arg=--x"]
    assert saturation.precision_label(["--quantization=fp8"], "bfloat16") == "fp8"
    assert saturation.precision_label(["--quantization", "fp8"], "bfloat16") == "fp8"
    assert saturation.precision_label(["--max-batch-size=4"], "bfloat16") == "bf16"
    with pytest.raises(SystemExit):
        saturation.build_parser().parse_args(["--out", "x", "--points", "512:20"])  # CLIENTS missing


def test_a_window_capped_below_one_latency_still_sees_clients_in_step_end_a_request():
    """Clients that start together stay in step: a window shorter than one latency can close before any of them
    answers. --max-window-s gives way to MIN_WINDOW_LATENCIES warm-up mean latencies."""
    latency = 0.3

    async def send(seed: int) -> Outcome:
        start = time.perf_counter()
        await asyncio.sleep(latency)
        return Outcome(seed, start, time.perf_counter(), images=1)

    outcomes, times = asyncio.run(saturation.closed_loop(
        send, saturation.Point(64, 2, 4), 0, ramp_s=0.0, warmup_s=0.0, max_warmup_s=5.0, window_s=0.05,
        window_latencies=0.0, max_window_s=0.1))
    assert times.measured_to - times.measured_from >= saturation.MIN_WINDOW_LATENCIES * latency
    inside = [o for o in outcomes if times.measured_from <= o.end <= times.measured_to]
    assert len(inside) >= 4  # every client ended a request inside the window


def test_a_window_where_no_request_ended_measured_no_throughput():
    result = _result("fp8", 0.0)
    result["points"][0].update(completed=0, latency_s=None)
    text = saturation_report.render([result])
    assert "| fp8 | 512x512/20, c16 | none ended in the window | - | 0 |" in text
    target = next(line for line in text.splitlines() if "fp8 >= 2.5" in line)
    assert target.endswith("| none ended in the window | not measured |")
    failed = _result("fp8", 0.0)
    failed["points"][0].update(completed=0, failed=5, latency_s=None)  # every request failed: a measured zero
    assert "| fp8 | 512x512/20, c16 | 0.000 |" in saturation_report.render([failed])
