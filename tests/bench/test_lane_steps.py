"""bench.lane_steps on the tiny model on the CPU: the streams decode their whole grids together, every step's rows
are counted (two a token with AR guidance), and the step's time splits into the forward's and the host's. Checks
what it writes, never how fast."""

from __future__ import annotations

import json

import pytest

from ar_service.decoding import RowParallel
from ar_service.prompt import grid_for_size
from bench import lane_steps


def test_row_parallel_streams_decode_their_grids_in_the_formulas_steps(tmp_path):
    out = tmp_path / "lanes.json"
    report = lane_steps.main(["--streams", "3", "--size", "128", "--lane-rows", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    grid = grid_for_size(128, 128, lane_steps.PIXELS_PER_TOKEN)
    assert report["grid"] == "8x8" and report["slots"] == 6 and report["lane_rows"] == 16
    assert report["steps"] == RowParallel.forwards(grid, 4)
    # every token a stream draws but its last (the look-ahead, never fed back)
    assert report["tokens_per_step"] == round(3 * (grid.decode_tokens - 1) / report["steps"], 2)
    assert report["rows_per_step"] == pytest.approx(2 * report["tokens_per_step"], abs=0.02)
    assert report["forward_ms"] > 0 and report["host_ms"] >= 0 and report["host_us_per_row"] >= 0
    assert report["step_ms"] == pytest.approx(report["forward_ms"] + report["host_ms"], abs=0.01)


def test_sequential_streams_feed_one_token_each_a_step_and_steps_can_be_capped():
    report = lane_steps.main(["--mode", "sequential", "--streams", "2", "--size", "64", "--steps", "5"])
    assert report["steps"] == 5 and report["window"] == 0 and report["lane_rows"] == 64
    assert report["tokens_per_step"] == 2 and report["rows_per_step"] == 4


def test_impossible_runs_are_refused():
    with pytest.raises(SystemExit):
        lane_steps.parse_args(["--streams", "0"])
    with pytest.raises(SystemExit):
        lane_steps.parse_args(["--mode", "fastest"])
    with pytest.raises(SystemExit):
        lane_steps.parse_args(["--profile", "-1"])


def test_profiled_steps_follow_the_measured_ones_and_share_out_their_time():
    report = lane_steps.main(["--streams", "2", "--size", "64", "--steps", "4", "--profile", "2"])
    assert report["steps"] == 4
    profile = report["profile"]
    # on the CPU no kernel is attributed: the operators are listed by their self CPU time
    assert profile["steps"] == 2 and profile["sorted_by"] == "self_cpu_time" and profile["total_ms_per_step"] > 0
    entries = profile["entries"]
    assert 0 < len(entries) <= lane_steps.PROFILE_ENTRIES
    assert all(0 < entry["share"] <= 1 and entry["calls"] > 0 for entry in entries)
    assert sum(entry["share"] for entry in entries) <= 1
    assert all(len(entry["name"]) <= lane_steps.PROFILE_NAME_CHARS for entry in entries)
    assert any("mm" in entry["name"] or "linear" in entry["name"] for entry in entries)


def test_no_profile_unless_asked():
    report = lane_steps.main(["--streams", "1", "--size", "64", "--steps", "2"])
    assert "profile" not in report


def test_both_in_place_reads_of_the_slots_can_be_named():
    """triton (each row reads its slot) and triton-slots (a slot's rows share a read) for one card to compare."""
    for way in ("triton", "triton-slots", "gather", "auto"):
        assert lane_steps.parse_args(["--lane-attention", way]).lane_attention == way
    with pytest.raises(SystemExit):
        lane_steps.parse_args(["--lane-attention", "paged"])


def test_the_attention_check_asks_for_a_cuda_device_by_name():
    """bench.lane_attention_check times the two reads on a GPU: on a machine without one it says so and stops."""
    from bench import lane_attention_check

    with pytest.raises(SystemExit, match="needs a CUDA device and the triton package"):
        lane_attention_check.main([])
