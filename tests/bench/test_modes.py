"""bench.modes' verdicts: the lossless check fails on one speculative PNG unlike sequential's or a row-parallel request
off its formula, the projection is the published speed-up applied to measured parts, and the page names its targets."""

from __future__ import annotations

import pytest

from ar_service.prompt import Grid
from bench import modes

SPEC = {"ar_decoding": "speculative", "ar_decoding_window": 8}
ROWS = {"ar_decoding": "row_parallel", "ar_decoding_window": 4}


def answer(label, size, seed, n, knobs, digests, forwards=None, latency=1.0, decode_ms=500.0, steps=20):
    timings = {"ar_forwards": forwards, "ar_decode_ms": decode_ms, "denoise_ms": 100.0, "ar_grid_width": 32,
               "ar_grid_height": 32, "ar_tokens": 1057 * n}
    return {"label": label, "size": size, "steps": steps, "seed": seed, "n": n, "knobs": knobs, "latency_s": latency,
            "timings": timings, "digests": digests, "error": None}


def lossless(spec_digests, rp_forwards):
    return [
        answer("reference sequential", 512, 1000, 3, {}, ["a", "b", "c"], 3168),
        answer("speculative w8, alone", 512, 1000, 3, SPEC, spec_digests, 3000),
        answer("row_parallel w4, among others", 512, 2000, 2, ROWS, ["x", "y"], rp_forwards),
    ]


def test_the_lossless_check_passes_only_when_every_png_and_forward_count_agrees():
    grids = modes.grids_of(lossless(["a", "b", "c"], 0))
    assert grids == {512: Grid(32, 32)}
    formula = 2 * (31 * 4 + 32)
    good = modes.lossless_verdict(lossless(["a", "b", "c"], formula), grids)
    assert good["pass"] and good["compared"] == good["identical"] == 3
    one_off = modes.lossless_verdict(lossless(["a", "B", "c"], formula), grids)
    assert not one_off["pass"] and one_off["mismatches"] == ["speculative w8, alone at 512, seed 1001"]
    miscounted = modes.lossless_verdict(lossless(["a", "b", "c"], formula + 1), grids)
    assert not miscounted["pass"] and miscounted["row_parallel"][0]["formula"] == formula
    assert not modes.lossless_verdict([], grids)["pass"]  # nothing compared is no pass


def test_the_projection_is_published_speedup_times_measured_forward_cost():
    c1 = [answer(modes.SEQUENTIAL, 1024, 0, 1, {}, ["s"], 1056, latency=10.0, decode_ms=6000.0, steps=50),
          answer("speculative, window 8", 1024, 0, 1, SPEC, ["s"], 1000, latency=11.0, decode_ms=7000.0, steps=50)]
    rows = modes.summarize(c1)
    assert {r["label"]: r["same_png_as_sequential"] for r in rows} == {modes.SEQUENTIAL: "1/1",
                                                                        "speculative, window 8": "1/1"}
    projected = {p["speedup"]: p for p in modes.projections(rows)}
    sjd = projected[2.2]
    assert sjd["ms_per_forward"] == pytest.approx(7.0)
    assert sjd["ar_decode_s"] == pytest.approx(1056 / 2.2 * 7.0 / 1e3)
    assert sjd["wall_s"] == pytest.approx(10.0 - 6.0 + 1056 / 2.2 * 7.0 / 1e3)
    assert projected[4.5]["wall_s"] < sjd["wall_s"]


def test_the_page_marks_each_target():
    c1 = [answer(modes.SEQUENTIAL, 1024, 0, 1, {}, ["s"], 1056, latency=9.2, steps=50),
          answer(modes.FASTEST, 1024, 0, 1, ROWS, ["t"], 156, latency=3.4, steps=50)]
    saturation = [{"precision": "bf16", "points": [{"size": 512, "steps": 20, "clients": 16, "knobs": {},
                                                    "throughput_images_per_s": 1.1,
                                                    "latency_s": {"p50": 14.0, "mean": 12.8}}]}]
    page = modes.render({"c1": c1, "machine": {"gpu": "NVIDIA H100 80GB HBM3"}}, saturation)
    assert "NVIDIA H100 80GB HBM3" in page
    saturation_row = next(line for line in page.splitlines() if line.startswith("| bf16 | 512/20 | 16 |"))
    assert "| 1.100 | 1.250 |" in saturation_row  # the window's count, then 16 clients over a 12.8 s mean latency
    assert saturation_row.endswith("| - | - | - | - | - |")  # no forwards, busy shares or window recorded
    verdicts = {row[0]: row[2] for row in modes.targets(modes.summarize(c1), saturation)}
    assert verdicts["1024x1024/50, one request, sequential <= 9.5 s"] == "pass"
    assert verdicts[f"1024x1024/50, one request, {modes.FASTEST} <= 3.0 s"] == "FAIL"
    assert verdicts["512x512/20, 16 clients, sequential >= 1.0 images/s"] == "pass"
    assert verdicts["512x512/20, 16 clients, with the speed modes >= 4.0 images/s"] == "n/a (not measured)"


def test_the_saturation_stage_gives_each_service_its_own_flags():
    """A flag for one service reaches only that one, after the stage's own (a later flag wins), and each service
    accepts what the stage gives it."""
    from ar_service.settings import ARSettings
    from dit_service.settings import DiTSettings
    from servicekit.settings import load_settings

    args = modes.parse_args(["--stages", "saturation", "--dit-arg=--max-batch-size=2",
                             "--ar-arg=--max-batch-size=8", "--ar-arg", "--capture-lane-graphs"])
    ar, dit = modes.saturation_service_args(args)
    assert "--quantization" in dit and "--quantization" not in ar  # the DiT in FP8 on CUDA, the AR in bf16
    assert dit[-1] == "--max-batch-size=2" and "--max-batch-size=2" not in ar
    assert ar[-2:] == ["--max-batch-size=8", "--capture-lane-graphs"]
    ar_settings, dit_settings = load_settings(ARSettings, ar), load_settings(DiTSettings, dit)
    assert ar_settings.capture_lane_graphs and ar_settings.max_batch_size == 8
    assert dit_settings.max_batch_size == 2 and dit_settings.quantization == "fp8"


def test_a_rendered_page_keeps_its_own_saturation_stage_and_each_engines_time_per_image(tmp_path):
    """``--render`` of a modes.json that ran the saturation stage shows that stage's points, and each point says how
    long each engine was busy per image (busy share over images/s): the figure a throughput target is held to."""
    import json

    point = {"size": 512, "steps": 20, "clients": 16, "knobs": ROWS, "throughput_images_per_s": 2.0,
             "latency_s": {"p50": 7.5, "mean": 8.0}, "window_s": 30.0,
             "batching": {"ar": {"busy_fraction": 0.8}, "dit": {"busy_fraction": 0.5}}}
    report = {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}, "saturation": {"label": "AR bf16, DiT FP8",
                                                                          "points": [point]}}
    (tmp_path / "modes.json").write_text(json.dumps(report))
    assert modes.main(["--render", str(tmp_path / "modes.json")]) == 0
    page = (tmp_path / modes.MARKDOWN_NAME).read_text()
    row = next(line for line in page.splitlines() if line.startswith("| AR bf16, DiT FP8 | 512/20 | 16 |"))
    assert "| 0.400 | 0.250 | 30.000 |" in row  # AR 0.8 / 2.0 s, DiT 0.5 / 2.0 s an image, then the window
    target = next(line for line in page.splitlines() if "16 clients, with the speed modes" in line)
    assert target.endswith("| 2.000 | FAIL |")  # 2.0 images/s against the target of 4
