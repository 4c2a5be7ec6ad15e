"""The bounds' method without a GPU: warm-up until steady on a made-up device whose clock the test drives, the
best of several sizes, how work is counted, nvidia-smi's answer, and the dashboard saying what its ratios are
taken against (and re-stating a finished run against bounds measured later). Nothing here asserts a speed."""

from __future__ import annotations

import argparse
import json
import math
import statistics

import pytest
import torch

from bench import bounds, dashboard, datasheet, ratios
from bench.bounds import Settings, steady_rate


class MadeUpDevice:
    """A device whose throughput at time t is ``rate_at(t)`` units per second; running one unit advances its
    clock by 1 / rate. ``clock`` is what the loop reads."""

    def __init__(self, rate_at):
        self.rate_at = rate_at
        self.now = 0.0

    def run(self) -> None:
        self.now += 1.0 / self.rate_at(self.now)

    def clock(self) -> float:
        return self.now


def _steady(device: MadeUpDevice, **settings) -> bounds.Steady:
    return steady_rate(device.run, 1.0, clock=device.clock, settings=Settings(**settings))


def test_warm_up_lasts_until_the_clocks_have_ramped():
    """An idle GPU ramps for seconds: the old 0.3 s warm-up read ~80% of the rate it settles at."""
    ramp = MadeUpDevice(lambda t: 600.0 + 200.0 * min(1.0, t / 3.0))  # 600 -> 800 over 3 s, past the 2 s minimum
    result = _steady(ramp)
    assert result.stable
    assert result.warm_s >= 3.0
    assert result.rate == pytest.approx(800.0, rel=0.01)
    assert result.warm_windows[0] < 650.0  # the ramp is in the record
    assert result.rate == max(result.windows) and result.median == statistics.median(result.windows)
    assert len(result.windows) == Settings().windows


def test_a_steady_device_is_warmed_up_for_the_minimum_and_little_more():
    flat = MadeUpDevice(lambda t: 800.0)
    result = _steady(flat, min_warm_s=2.0, window_s=0.2)
    assert result.stable and 2.0 <= result.warm_s < 2.0 + 4 * 0.2
    assert result.rate == pytest.approx(800.0) and result.runs_per_window == 160


def test_a_boost_that_does_not_last_is_not_the_bound():
    """The figure comes from the windows timed after the rate settled, not from the warm-up's best window."""
    boost = MadeUpDevice(lambda t: 900.0 if t < 1.0 else 760.0)
    result = _steady(boost)
    assert max(result.warm_windows) == pytest.approx(900.0)
    assert result.rate == pytest.approx(760.0)


def test_a_rate_that_never_settles_ends_at_the_limit_and_says_so():
    climbing = MadeUpDevice(lambda t: 100.0 * 1.2**t)  # ~3.7% faster every 0.2 s window: never within 1.5%
    result = _steady(climbing, max_warm_s=6.0)
    assert not result.stable
    assert 6.0 <= result.warm_s < 6.0 + 0.5


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="windows and agree"):
        Settings(windows=0)


def test_copy_bytes_count_the_read_and_the_write():
    probe = bounds.copy_probe(torch.device("cpu"), 1001)  # bf16: 500 values
    assert probe.size == {"bytes": 1000}
    assert probe.work == 2 * 1000  # every byte read once and written once
    out = probe.run()
    assert out.numel() == 500 and bool((out == 1).all())


def test_matmul_flops_are_two_m_k_n():
    probe = bounds.matmul_probe(torch.device("cpu"), (64, 32, 16), torch.float32)
    assert probe.size == {"shape": [64, 32, 16]} and probe.work == 2 * 64 * 32 * 16
    assert tuple(probe.run().shape) == (64, 16)


QUICK = Settings(min_warm_s=0.0, window_s=0.005, tolerance=10.0, windows=2, max_warm_s=0.1)


def test_the_bound_is_the_best_size_and_every_size_is_kept():
    shapes = [(64, 64, 64), (128, 64, 32), (96, 96, 96)]
    matmul = bounds.matmul_rate("cpu", shapes, torch.float32, QUICK)
    assert [size["shape"] for size in matmul["sizes"]] == [list(s) for s in shapes]
    best = max(matmul["sizes"], key=lambda size: size["tflop_per_s"])
    assert matmul["tflop_per_s"] == best["tflop_per_s"] and matmul["shape"] == best["shape"]
    copy = bounds.copy_bandwidth("cpu", [2**16, 2**18], QUICK)
    assert [size["bytes"] for size in copy["sizes"]] == [2**16, 2**18]
    assert copy["gb_per_s"] == max(size["gb_per_s"] for size in copy["sizes"])
    with pytest.raises(ValueError, match="no sizes"):
        bounds.best_of([], "gb_per_s")


def test_a_cpu_measurement_has_no_datasheet_and_no_nvidia_smi(tmp_path):
    assert bounds.main(["--device", "cpu", "--matmul", "64", "--copy-mib", "0.25", "--warm-s", "0", "--max-warm-s",
                        "0.1", "--windows", "1", "--out", str(tmp_path / "b.json")]) == 0
    measured = json.loads((tmp_path / "b.json").read_text())
    assert measured["datasheet"] is None and measured["gpu_idle"] is None and measured["device_name"] is None
    assert measured["method"]["min_warm_s"] == 0 and measured["command"].startswith("python -m bench.bounds")
    assert measured["copy"]["sizes"][0]["bytes"] == 2**18 and measured["matmul"]["shape"] == [64, 64, 64]


def test_nvidia_smi_answers_are_read_and_a_missing_one_is_no_reading():
    line = "NVIDIA H200, 1980, 1980, 3201, 3201, 651.20, 700.00, 48, P0"
    state = bounds.parse_smi(line)
    assert state["clocks.sm"] == 1980.0 and state["power.draw"] == 651.2 and state["pstate"] == "P0"
    assert state["name"] == "NVIDIA H200"
    assert bounds.parse_smi(line.replace("651.20", "[N/A]"))["power.draw"] is None
    with pytest.raises(ValueError, match="expected 9"):
        bounds.parse_smi("NVIDIA H200, 1980")
    assert bounds.gpu_state(torch.device("cpu")) is None


def test_shapes_and_sizes_on_the_command_line():
    assert bounds.parse_shapes("4096, 16384x8192x8192") == [(4096, 4096, 4096), (16384, 8192, 8192)]
    assert bounds.parse_mib("256,1024") == [256 * 2**20, 2**30]
    for bad in ("", "8x8", "a", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            bounds.parse_shapes(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        bounds.parse_mib("lots")


def test_only_known_cards_get_a_datasheet_figure():
    assert datasheet.peaks("NVIDIA H200")["source"] == "NVIDIA H200 datasheet"
    assert datasheet.peaks("Some Future GPU") is None and datasheet.peaks(None) is None


# -- the dashboard: against what, and re-stated ----------------------------------------------------------------------


def _measured(name: str | None, gb_per_s: float, tflops: float, **extra) -> dict:
    """A bounds record in the shape bench.bounds writes (made-up figures)."""
    return {"device": "cuda", "device_name": name, "date": "2026-12-04T00:00:00+00:00",
            "command": "python -m bench.bounds --out b.json",
            "method": {**Settings().__dict__},
            "copy": {"gb_per_s": gb_per_s, "bytes": 2**30,
                     "sizes": [{"bytes": 2**30, "gb_per_s": gb_per_s, "warm_s": 2.2, "stable": True}]},
            "matmul": {"tflop_per_s": tflops, "shape": [8192] * 3, "dtype": "bfloat16",
                       "sizes": [{"shape": [8192] * 3, "tflop_per_s": tflops, "warm_s": 3.1, "stable": True,
                                  "gpu_under_load": {"clocks.sm": 1980.0, "clocks.max.sm": 1980.0}}]},
            "datasheet": datasheet.peaks(name), "gpu_idle": None, **extra}


def _raw(measured: dict) -> dict:
    """A finished run's report whose stages took 4.0 ms per AR token and reached 480 TFLOP/s in the DiT."""
    row = {"size": 1024, "steps": 50, "service_ar_ms_per_token": 4.0, "service_dit_tflop_per_s": 480.0,
           "dit_flops": {"flops": 1.7e15, "condition_tokens": 251, "image_tokens": 4096, "transformer_calls": 100}}
    weight_bytes = 13.0e9
    return {"machine": {"gpu": measured["device_name"]}, "via": "rest", "points": [],
            "bounds": {"measured": measured, "decode_weight_bytes": weight_bytes, "dtype_bytes": 2,
                       "per_size": [ratios.set_ratios(row, weight_bytes, measured)]}}


def test_each_ratio_says_what_it_is_taken_against():
    raw = _raw(_measured("NVIDIA H200", 4000.0, 600.0))
    rows = {row[0]: row[1] for row in dashboard.targets(raw)}
    dit = rows["DiT >= 60% of measured matmul rate (1024/50, c1)"]
    assert dit.startswith("80.0% of the measured 600.0 TFLOP/s") and "of the datasheet's 989" in dit
    ar = rows["AR ms/token within 1.3x of bound (1024/50, c1)"]
    assert "vs 3.250 ms: its weights read at the measured 4,000 GB/s" in ar and "the datasheet's 4,800 GB/s" in ar
    text = dashboard.markdown(raw, "skipped")
    assert "Ratios to bounds are taken against the measured copy bandwidth 4,000 GB/s and bfloat16 matmul rate " \
           "600.0 TFLOP/s" in text
    assert "measured in this run" in text and "NVIDIA H200 datasheet" in text
    assert "under the best matmul: SM 1980 of 1980 MHz" in text
    unknown = dashboard.markdown(_raw(_measured("Some Future GPU", 4000.0, 600.0)), "skipped")
    assert "No datasheet figure is known for this device" in unknown and "of the datasheet's" not in unknown


def test_a_run_recorded_before_the_datasheet_column_gets_it_from_the_device_name():
    """The committed H200 runs' bounds were one size, best of 10, with no datasheet recorded."""
    old = {"device": "cuda", "device_name": "NVIDIA H200",
           "copy": {"bytes": 2**30, "repeats": 10, "gb_per_s": 4158.0},
           "matmul": {"n": 8192, "dtype": "bfloat16", "repeats": 10, "tflop_per_s": 671.4}}
    raw = _raw(old)
    for row in raw["bounds"]["per_size"]:
        row.pop("service_dit_fraction_of_datasheet")
    text = dashboard.markdown(raw, "skipped")
    assert "the best of 10 single runs after at most 0.3 s of warm-up" in text
    assert "48.5% of the datasheet's 989" in text  # 480 / 989


def test_a_finished_run_is_restated_against_bounds_measured_later(tmp_path):
    run = _raw(_measured("NVIDIA H200", 4000.0, 600.0))
    (tmp_path / "raw.json").write_text(json.dumps(run))
    (tmp_path / "bounds.json").write_text(json.dumps(_measured("NVIDIA H200", 4270.0, 780.0)))
    assert dashboard.main([str(tmp_path / "raw.json"), "--bounds", str(tmp_path / "bounds.json"),
                           "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "DASHBOARD.md").read_text()
    assert "61.5% of the measured 780.0 TFLOP/s (480.0 TFLOP/s" in text  # the same 480 TFLOP/s, a higher bound
    assert "1.31x (4.000 vs 3.044 ms: its weights read at the measured 4,270 GB/s" in text
    assert "not in this run" in text and "(bounds.json)" in text
    assert "This run's own measurement" in text and "copy bandwidth 4,000 GB/s and bfloat16 matmul rate 600.0" in text
    assert json.loads((tmp_path / "raw.json").read_text()) == run  # the run's record is left as it was


def test_restating_keeps_the_timings_and_only_moves_the_ratios():
    run = _raw(_measured("NVIDIA H200", 4000.0, 600.0))
    restated = ratios.restate(run["bounds"], _measured("NVIDIA H200", 5000.0, 960.0), "b.json")
    [before], [after] = run["bounds"]["per_size"], restated["per_size"]
    assert after["service_dit_tflop_per_s"] == before["service_dit_tflop_per_s"] == 480.0
    assert after["service_ar_ms_per_token"] == before["service_ar_ms_per_token"] == 4.0
    assert after["service_dit_fraction_of_matmul"] == pytest.approx(0.5)
    assert after["ar_bound_ms_per_token"] == pytest.approx(13.0e9 / 5000e9 * 1e3)
    assert restated["measured_in_run"]["copy"]["gb_per_s"] == 4000.0
    twice = ratios.restate(restated, _measured("NVIDIA H200", 4500.0, 900.0), "c.json")
    assert twice["measured_in_run"]["copy"]["gb_per_s"] == 4000.0  # still the run's own, not the first re-statement
    assert math.isclose(run["bounds"]["per_size"][0]["service_dit_fraction_of_matmul"], 0.8)  # input untouched


def test_restating_refuses_bounds_of_another_card_or_a_run_without_bounds(tmp_path, capsys):
    (tmp_path / "raw.json").write_text(json.dumps(_raw(_measured("NVIDIA H200", 4000.0, 600.0))))
    (tmp_path / "other.json").write_text(json.dumps(_measured("NVIDIA H100 80GB HBM3", 3000.0, 700.0)))
    (tmp_path / "junk.json").write_text(json.dumps({"points": []}))
    (tmp_path / "no_bounds.json").write_text(json.dumps({"machine": {"gpu": "NVIDIA H200"}, "points": []}))
    (tmp_path / "bounds.json").write_text(json.dumps(_measured("NVIDIA H200", 4270.0, 780.0)))
    for raw, bounds_file, message in (("raw.json", "other.json", "measured on NVIDIA H100 80GB HBM3, the run on NVIDIA H200"),
                                      ("raw.json", "junk.json", "is not a bounds file"),
                                      ("no_bounds.json", "bounds.json", "no bounds rows to re-state")):
        with pytest.raises(SystemExit) as exited:
            dashboard.main([str(tmp_path / raw), "--bounds", str(tmp_path / bounds_file), "--out", str(tmp_path / "o")])
        assert exited.value.code == 2
        assert message in capsys.readouterr().err


def test_bad_timing_options_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        bounds.main(["--device", "cpu", "--windows", "0"])
    assert exited.value.code == 2 and "windows and agree must be at least 1" in capsys.readouterr().err
