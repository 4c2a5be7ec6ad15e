"""The harness's pieces without services: byte and FLOP counts against the real module trees, the closed loop's
arithmetic, and the dashboard's verdicts."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from ar_service.model.configuration import ar_config_from_dict
from ar_service.model.loading import build_ar
from ar_service.model.tiny import preview_llm_config, tiny_llm_config
from bench import dashboard, harness, workload
from bench.harness import Outcome, closed_loop, percentile, summarize
from bench.services import ServiceStack


def _ar_config(llm_config: dict):
    return ar_config_from_dict({"model_type": "mammothmoda2", "llm_config": llm_config})


def _decode_params_from_modules(config) -> int:
    """What a generation token touches, read off the built module tree (meta device): the expert copy of a layer's
    attention / MLP where it exists, else the text copy; the norms; gen_head."""
    model = build_ar(config)
    lm = model.model.language_model
    total = 0
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    for layer in lm.layers:
        attn = layer.self_attn
        prefix = "gen_" if getattr(attn, "gen_q_proj", None) is not None else ""
        total += sum(count(getattr(attn, f"{prefix}{name}_proj")) for name in "qkvo")
        total += count(layer.gen_mlp if layer.gen_mlp is not None else layer.mlp)
        total += count(layer.input_layernorm) + count(layer.post_attention_layernorm)
    return total + count(lm.norm) + count(model.gen_head)


@pytest.mark.parametrize("llm_config", [tiny_llm_config(), preview_llm_config()], ids=["tiny", "preview"])
def test_decode_weight_bytes_match_the_module_tree(llm_config):
    config = _ar_config(llm_config)
    assert workload.decode_weight_bytes(config, 2) == 2 * _decode_params_from_modules(config)
    assert workload.decode_weight_bytes(config, 4) == 4 * _decode_params_from_modules(config)


def test_preview_decode_bytes_leave_out_the_text_head():
    config = _ar_config(preview_llm_config())
    weight_bytes = workload.decode_weight_bytes(config, 2)
    assert config.vocab_size * config.hidden_size * 2 > 1e9  # lm_head alone would be over 1 GB
    assert 12e9 < weight_bytes < 14e9


def test_dit_linear_flops_match_a_flop_counter(tiny_model):
    """FlopCounterMode counts the matmuls of a real forward of the tiny DiT; the analytic linear part must agree
    (counting the rows the per-sample linears are padded to). Attention is analytic only (CPU SDPA is not
    counted by the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from dit_service.model.pipeline import DiTPipeline
    from dit_service.model.transformer import MIN_ROWS

    config = json.loads((tiny_model / "config.json").read_text())
    pipeline = DiTPipeline.from_config(config, "cpu", torch.float32, random_weights=True)
    shape = workload.DiTShape.from_root_config(config)
    for size, condition in ((128, 40), (256, 100), (256, 0)):
        latents = torch.randn(1, pipeline.latent_channels, size // 8, size // 8)
        cond = torch.randn(1, condition, shape.condition_dim)
        with FlopCounterMode(display=False) as counter:
            pipeline.transformer(latents, torch.tensor([0.3]), cond, [condition])
        image = shape.latent_tokens(size, size)
        linear, attention = shape.forward_flops_parts(condition, image, sample_rows=MIN_ROWS)
        assert counter.get_total_flops() == linear
        assert shape.forward_flops_parts(condition, image)[0] < linear  # the useful work leaves the padding out
        assert attention > 0


def test_denoise_flops_count_guided_steps_and_the_refiner_rows():
    from dit_service.model.pipeline import preview_gen_parts

    config = {"model_type": "mammothmoda2", "llm_config": preview_llm_config(), **preview_gen_parts(3584)}
    guided = workload.denoise_flops(config, 1024, 1024, 50, 20, 64, 64, guidance=9.0)
    unguided = workload.denoise_flops(config, 1024, 1024, 50, 20, 64, 64, guidance=1.0)
    assert guided["image_tokens"] == 4096
    assert guided["condition_tokens"] == 20 + 128  # text + the Q-Former's queries (replacing 64 * 65 image rows)
    assert guided["transformer_calls"] == 100 and unguided["transformer_calls"] == 50
    assert unguided["flops"] == pytest.approx(50 * guided["cond_forward_flops"])
    assert guided["uncond_forward_flops"] < guided["cond_forward_flops"]
    # With no refiner the image condition is the whole grid: ar_h * (ar_w + 1) rows.
    bare = {**config, "gen_image_condition_refiner_config": None}
    assert workload.condition_tokens(bare, 20, 64, 64) == 20 + 64 * 65


def test_percentiles_are_ordered_and_interpolated():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile([7.0], 99) == 7.0


def test_closed_loop_ramps_clients_and_sends_each_request_once():
    """Client i waits i * ramp before its first request (recorded, not timed); every request is sent once."""
    waits, lock = {}, threading.Lock()

    def sleep(seconds):
        with lock:
            waits[threading.current_thread().name] = seconds

    def send(size, steps, seed, guidance):
        return Outcome(seed, float(seed), float(seed) + 1.0, images=1, timings={"ar_decode_ms": 10.0, "ar_tokens": 5})

    outcomes = closed_loop(send, 64, 2, concurrency=3, requests=7, ramp_s=0.02, first_seed=100, guidance=None,
                           sleep=sleep)
    assert sorted(o.seed for o in outcomes) == list(range(100, 107))
    assert waits == {"client-0": 0.0, "client-1": pytest.approx(0.02), "client-2": pytest.approx(0.04)}


def test_summary_of_given_outcomes():
    """Percentiles, throughput and stage means of outcomes with fixed start and end times (no clock involved)."""
    outcomes = [Outcome(k, float(k), float(k) + 1.0 + k, images=1, timings={"ar_decode_ms": 10.0, "ar_tokens": 5})
                for k in range(5)]  # latencies 1..5 s, first start 0, last end 9
    summary = summarize(outcomes)
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert summary["latency_s"]["p50"] <= summary["latency_s"]["p95"] <= summary["latency_s"]["p99"]
    assert (summary["latency_s"]["p50"], summary["latency_s"]["p95"]) == (3.0, pytest.approx(4.8))
    assert summary["throughput_images_per_s"] > 0
    assert summary["throughput_images_per_s"] == pytest.approx(5 / 9)
    assert summary["stages_ms"]["ar_ms_per_token"] == pytest.approx(2.0)
    assert "ar_tokens_per_forward" not in summary["stages_ms"]  # services that count no forwards


def test_summary_reports_the_ar_tokens_decided_per_forward():
    """Requests of 73 tokens in 72 and in 14 forwards: 146 tokens over 86 forwards, and the mean forwards."""
    outcomes = [Outcome(k, 0.0, 1.0, images=1, timings={"ar_decode_ms": 10.0, "ar_tokens": 73, "ar_forwards": f})
                for k, f in enumerate((72, 14))]
    stages = summarize(outcomes)["stages_ms"]
    assert stages["ar_tokens_per_forward"] == pytest.approx(146 / 86)
    assert stages["ar_forwards"] == pytest.approx(43.0)


def test_steady_throughput_leaves_out_the_ramp_and_the_drain():
    """Two clients, each request 2 s, the second client 1 s behind: 1 image/s once both run (fixed times)."""
    timings = {"ar_decode_ms": 10.0, "ar_tokens": 5}
    outcomes = [Outcome(k, float(k), float(k) + 2.0, images=1, timings=timings) for k in range(6)]  # last end 7
    summary = summarize(outcomes, concurrency=2)
    assert summary["throughput_images_per_s"] == pytest.approx(6 / 7)
    assert summary["steady_throughput_images_per_s"] == pytest.approx(1.0)  # 4 ends in (1, 5] over 4 s
    assert summary["steady_window_s"] == pytest.approx(4.0)
    one_client = [Outcome(k, float(k), float(k) + 1.0, images=1) for k in range(3)]
    assert harness.steady_throughput(one_client, 1) == (pytest.approx(1.0), pytest.approx(2.0))
    assert harness.steady_throughput(outcomes[:2], 2) == (None, 0.0)  # no more requests than clients: no window


def test_failed_requests_are_counted_not_averaged():
    ok = Outcome(1, 0.0, 1.0, images=1, timings={"ar_decode_ms": 4.0, "ar_tokens": 2, "total_ms": 900.0})
    bad = Outcome(2, 0.5, 3.0, error="HTTP 429: busy")
    summary = summarize([ok, bad])
    assert summary["completed"] == 1 and summary["failed"] == 1 and summary["errors"] == ["HTTP 429: busy"]
    assert summary["latency_s"]["mean"] == 1.0
    assert summary["throughput_images_per_s"] == pytest.approx(1 / 3.0)


def _run(c, mean, throughput):
    return {"concurrency": c, "requests": 4, "completed": 4, "latency_s": {"mean": mean, "p50": mean, "p95": mean,
            "p99": mean}, "throughput_images_per_s": throughput}


def test_dashboard_verdicts_follow_the_numbers_they_are_given():
    """The targets table's pass/fail logic on fixed numbers (no measurement here: the harness measures)."""
    raw = {
        "via": "rest",
        "points": [{"size": 512, "steps": 20, "runs": [_run(1, 5.0, 0.2), _run(4, 8.0, 0.6)]},
                   {"size": 1024, "steps": 50, "runs": [_run(1, 30.0, 1 / 30)]}],
        "transport_overhead": [{"size": 512, "steps": 20, "overhead": 0.01}],
        "bounds": {"per_size": [{"size": 512, "steps": 20, "ar_bound_ms_per_token": 3.0,
                                 "service_ar_ms_per_token": 3.6, "service_ar_ratio_to_bound": 1.2,
                                 "service_dit_tflop_per_s": 500.0, "service_dit_fraction_of_matmul": 0.5}]},
    }
    verdicts = {row[0]: row[2] for row in dashboard.targets(raw)}
    assert verdicts["AR ms/token within 1.3x of bound (512/20, c1)"] == "pass"
    assert verdicts["DiT >= 60% of measured matmul rate (512/20, c1)"] == "FAIL"
    assert verdicts["transport overhead <= 2% at 512 (c1, via rest)"] == "pass"
    assert verdicts["1024/50 steps c1 mean latency <= 25 s"] == "FAIL"
    assert verdicts["512/20 steps c1 mean latency <= 6 s"] == "pass"
    assert verdicts["c4 throughput >= 3.5x c1 at 512/20"] == "FAIL"  # 3.0x
    assert "| target | measured | verdict |" in dashboard.markdown(raw, "skipped")


def test_dashboard_sets_the_in_process_decode_gpu_time_against_its_wall_time():
    stages = {"ar_ms_per_token": 6.6, "ar_device_ms_per_token": 4.5}
    raw = {"via": "rest", "points": [], "inprocess": {"points": [{"size": 512, "steps": 20, "stages_mean": stages}]}}
    text = dashboard.markdown(raw, "skipped")
    assert "512/20: 4.500 of 6.600 ms" in text
    without = {"via": "rest", "points": [], "inprocess": {"points": [
        {"size": 512, "steps": 20, "stages_mean": {"ar_ms_per_token": 6.6}}]}}
    assert "on the GPU" not in dashboard.markdown(without, "skipped")


def test_runs_of_one_machine_merge_into_one_dashboard(tmp_path):
    """A sweep split over two runs (each within a time limit) gives one dashboard with both sizes."""
    machine = {"gpu": "NVIDIA H200"}
    small = {"machine": machine, "via": "rest", "command": "a", "date": "d1", "peak_gpu_mib": {"ar_service": 10},
             "points": [{"size": 512, "steps": 20, "runs": [_run(1, 5.0, 0.2), _run(4, 8.0, 0.6)]}]}
    large = {"machine": machine, "via": "rest", "command": "b", "date": "d2", "peak_gpu_mib": {"ar_service": 30},
             "points": [{"size": 1024, "steps": 50, "runs": [_run(1, 24.0, 1 / 24)]}],
             "transport_overhead": [{"size": 1024, "steps": 50, "overhead": 0.01}]}
    for i, raw in enumerate((small, large)):
        (tmp_path / f"{i}.json").write_text(json.dumps(raw))
    assert dashboard.main([str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--out", str(tmp_path / "out")]) == 0
    merged = json.loads((tmp_path / "out" / "merged.json").read_text())
    assert [p["size"] for p in merged["points"]] == [512, 1024]
    assert merged["peak_gpu_mib"] == {"ar_service": 30} and merged["command"] == "a ; b"
    verdicts = {row[0]: row[2] for row in dashboard.targets(merged)}
    assert verdicts["1024/50 steps c1 mean latency <= 25 s"] == "pass"
    assert verdicts["512/20 steps c1 mean latency <= 6 s"] == "pass"
    assert "| 1024/50 |" in (tmp_path / "out" / "DASHBOARD.md").read_text()
    with_bounds = dashboard.merge([{**small, "bounds": {"measured": "first", "per_size": [{"size": 512}]}},
                                   {**large, "bounds": {"measured": "second", "per_size": [{"size": 1024}]}}])
    assert with_bounds["bounds"]["measured"] == "first"
    assert [row["size"] for row in with_bounds["bounds"]["per_size"]] == [512, 1024]
    with pytest.raises(ValueError, match="different machines"):
        dashboard.merge([small, {**large, "machine": {"gpu": "other"}}])


def test_point_and_concurrency_parsing():
    assert harness.parse_points("512:20, 1024:50") == [(512, 20), (1024, 50)]
    assert harness.parse_ints("1,2,4,8") == [1, 2, 4, 8]
    args = harness.build_parser().parse_args(["--out", "x", "--sizes", "256:2"])
    assert args.points == [(256, 2)] and args.concurrency == [1, 2, 4, 8] and args.max_concurrency == {}
    args = harness.build_parser().parse_args(["--out", "x", "--max-concurrency", "1024=2, 2048=1"])
    assert args.max_concurrency == {1024: 2, 2048: 1}
    with pytest.raises(SystemExit):
        harness.build_parser().parse_args(["--out", "x", "--max-concurrency", "1024"])


def test_each_model_service_gets_only_its_own_environment(tmp_path):
    args = harness.build_parser().parse_args(
        ["--out", "x", "--env-ar", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40, A=b=c", "--env-dit", "CUDA_VISIBLE_DEVICES=1"])
    assert args.env_ar == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40", "A": "b=c"}
    stack = ServiceStack(tmp_path, tmp_path / "logs", device="cpu", env_ar=args.env_ar, env_dit=args.env_dit)
    assert stack.environment("ar_service")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert stack.environment("ar_service").get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert stack.environment("dit_service")["CUDA_VISIBLE_DEVICES"] == "1"
    assert "A" not in stack.environment("gateway") and "A" not in stack.environment("dit_service")
    with pytest.raises(SystemExit):
        harness.build_parser().parse_args(["--out", "x", "--env-dit", "NO_VALUE"])


def test_knobs_given_on_the_command_line_keep_their_json_types():
    args = harness.build_parser().parse_args(["--out", "x", "--knob", "ar_cfg_scale=1", "--knob", "cfg_range=[0, 0.5]",
                                              "--knob", "cfg_execution_mode=packed"])
    assert dict(args.knob) == {"ar_cfg_scale": 1, "cfg_range": [0, 0.5], "cfg_execution_mode": "packed"}
    with pytest.raises(SystemExit):
        harness.build_parser().parse_args(["--out", "x", "--knob", "no-equals-sign"])


def test_the_guidance_comparison_sets_each_scale_against_the_unguided_run():
    from bench.ar_guidance import compare, markdown

    def run(size, c, scale, decode_ms, latency):
        return {"size": size, "steps": 20, "concurrency": c, "ar_cfg_scale": scale, "failed": 0,
                "latency_s": {"mean": latency}, "throughput_images_per_s": c / latency,
                "stages_ms": {"ar_decode_ms": decode_ms, "ar_ms_per_token": decode_ms / 1057, "ar_prefill_ms": 20.0,
                              "denoise_ms": 600.0, "total_ms": latency * 1e3}}

    runs = [run(512, 1, 1.0, 4200.0, 5.0), run(512, 4, 1.0, 5600.0, 6.5), run(512, 1, 6.0, 4620.0, 5.4),
            run(512, 4, 6.0, 6720.0, 7.8)]
    rows = compare(runs)
    assert [(r["concurrency"], r["base_scale"], r["scale"]) for r in rows] == [(1, 1.0, 6.0), (4, 1.0, 6.0)]
    assert rows[0]["ar_decode_ratio"] == pytest.approx(1.1) and rows[1]["latency_ratio"] == pytest.approx(1.2)
    text = markdown({"command": "c", "date": "d", "machine": {"gpu": "H200"}, "model": "preview-random",
                     "startup_s": 30.0, "runs": runs, "comparison": rows})
    assert "| 512/20 | 4 | 1 -> 6 | 5.60 -> 6.72 |" in text
