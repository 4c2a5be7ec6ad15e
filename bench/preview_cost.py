"""What a partial image costs against the render it previews, and how soon a streamed request starts answering.

Usage (one GPU): ``python -m bench.preview_cost --out $OUT/preview_cost.json [--points 1024:50] [--no-stack]``.

1. In one process, no services (torch and diffusers only): the Preview-shaped DiT stage with random bf16 weights, its
   denoise step replayed from CUDA graphs as dit_service runs it, renders one image per point (``--points``, size:steps,
   guidance on every step) and times the render (denoise + VAE decode + PNG encode). Then, on the latents of the middle
   step, it times one preview as dit_service makes it (``DiTPipeline.preview``: the latent-to-RGB map, upsampling,
   copy to the host; then the encode, at the engine's preview PNG level), ``--repeats`` times, in PNG and JPEG. It
   reports the medians, one preview's share of the render (the target: below 5%), three previews' share, the one-off
   fit of the map, and the VAE decode a preview avoids.
2. Unless ``--no-stack``: the three services (bench/services.py, Preview-shaped, random weights), one unstreamed
   request, then the same request streamed with ``partial_images`` 3: seconds to the response headers, to the first
   byte of the body (the ``ardit.started`` comment), to the first progress comment, to each partial image and image, to
   ``[DONE]``; the services' own stage timings (``preview_ms`` among them) from the stream's ``ardit.completed``.

``--tiny --device cpu`` runs both on the tiny model, as a dry run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.report import emit

PROMPT = "a photo of a red fox sitting in fresh snow, golden hour"
TEXT_POSITIONS = 123  # a prompt of ~100 words in the T2I template (as bench.dit_graphs)


def _parse_points(text: str) -> list[tuple[int, int]]:
    points = []
    for item in text.split(","):
        size, _, steps = item.partition(":")
        points.append((int(size), int(steps or 50)))
    return points


def inprocess(points, guidance: float, repeats: int, device: str, tiny_dir: Path | None) -> dict:
    import torch

    from dit_service.imaging import PREVIEW_PNG_COMPRESS_LEVEL, encode_image
    from dit_service.model.pipeline import DiTPipeline, preview_dit_config
    from dit_service.settings import DiTSettings
    from servicekit.checkpoint import open_checkpoint

    if tiny_dir is None:
        pipeline = DiTPipeline.from_config(preview_dit_config(), device=device, dtype=torch.bfloat16, random_weights=True)
    else:
        pipeline = DiTPipeline.from_checkpoint(open_checkpoint(tiny_dir), device=device)
    pipeline.use_cuda_graphs(DiTSettings.model_fields["cuda_graphs"].default)
    started = time.perf_counter()
    pipeline.previewer  # noqa: B018 - the one-off fit of the map to the VAE
    pipeline.synchronize()
    fit_ms = (time.perf_counter() - started) * 1e3
    pipeline.warm_up()
    generator = torch.Generator().manual_seed(0)
    hidden = pipeline.condition_dim
    results = {"previewer_fit_ms": round(fit_ms, 2), "points": {}}
    for size, steps in points:
        grid = size // 16
        text = torch.randn(TEXT_POSITIONS, hidden, generator=generator)
        image = torch.randn(grid * (grid + 1), hidden, generator=generator)
        uncond = text.new_zeros(0, hidden)
        for _attempt in ("warm", "measured"):  # the first render captures the step's CUDA graphs
            entry = pipeline.start_entry(text, image, uncond, size, size, seed=1, steps=steps, guidance=guidance)
            pipeline.synchronize()
            t0 = time.perf_counter()
            middle = None
            while not entry.done:
                pipeline.step([entry])
                if entry.step == steps // 2:
                    pipeline.synchronize()
                    middle = (entry.latents.clone(), entry.velocity.clone(), entry.step)
            pipeline.synchronize()
            t1 = time.perf_counter()
            pixels = pipeline.decode(entry.latents)
            t2 = time.perf_counter()
            encode_image(pixels, "png")
            t3 = time.perf_counter()
        render_ms = (t3 - t0) * 1e3
        # One preview of the middle step, as the engine makes it.
        entry.latents, entry.velocity, entry.step = middle
        timings: dict[str, dict[str, list[float]]] = {fmt: {"pixels": [], "encode": []} for fmt in ("png", "jpeg")}
        for fmt in timings:
            for _ in range(repeats):
                pipeline.synchronize()
                a = time.perf_counter()
                preview = pipeline.preview(entry)  # ends with the copy to the host: the device work is in
                b = time.perf_counter()
                encode_image(preview, fmt, png_level=PREVIEW_PNG_COMPRESS_LEVEL)  # as the engine encodes previews
                c = time.perf_counter()
                timings[fmt]["pixels"].append((b - a) * 1e3)
                timings[fmt]["encode"].append((c - b) * 1e3)
        per_format = {}
        for fmt, parts in timings.items():
            pixels_ms, encode_ms = statistics.median(parts["pixels"]), statistics.median(parts["encode"])
            total = pixels_ms + encode_ms
            per_format[fmt] = {
                "pixels_ms": round(pixels_ms, 3), "encode_ms": round(encode_ms, 3), "preview_ms": round(total, 3),
                "share_of_render": round(total / render_ms, 5), "three_previews_share": round(3 * total / render_ms, 5),
            }
        results["points"][f"{size}x{size}"] = {
            "steps": steps, "guidance": guidance, "image_shape": list(preview.shape),
            "render_ms": round(render_ms, 1), "denoise_ms": round((t1 - t0) * 1e3, 1),
            "vae_decode_ms": round((t2 - t1) * 1e3, 2), "png_encode_ms": round((t3 - t2) * 1e3, 2),
            "preview": per_format,
            "below_5_percent": per_format["png"]["share_of_render"] < 0.05,
        }
    return results


def stream_through_services(size: int, steps: int, guidance: float, workdir: Path, logs: Path, device: str,
                            tiny: bool) -> dict:
    import httpx

    from bench.services import ServiceStack, make_model_dir

    stack = ServiceStack(make_model_dir(workdir, tiny), logs, device=device, random_weights=not tiny)
    body = {"prompt": PROMPT, "size": f"{size}x{size}", "num_inference_steps": steps, "text_guidance_scale": guidance,
            "seed": 0}
    try:
        startup_s = stack.start(timeout_s=900)
        url = f"{stack.url}/v1/images/generations"
        began = time.perf_counter()
        plain = httpx.post(url, json=body, timeout=3600)
        plain.raise_for_status()
        unstreamed_s = time.perf_counter() - began
        marks: dict[str, float] = {}
        partials, images, summary = [], [], None
        began = time.perf_counter()
        with httpx.stream("POST", url, json={**body, "stream": True, "partial_images": 3}, timeout=3600) as response:
            response.raise_for_status()
            marks["headers_s"] = time.perf_counter() - began
            event = None
            for line in response.iter_lines():
                now = time.perf_counter() - began
                marks.setdefault("first_byte_s", now)
                if line.startswith(": ardit.progress"):
                    marks.setdefault("first_progress_s", now)
                elif line.startswith(": ardit.completed"):
                    summary = json.loads(line.split(" ", 2)[2])
                elif line.startswith("event:"):
                    event = line.removeprefix("event:").strip()
                elif line.startswith("data: [DONE]"):
                    marks["done_s"] = now
                elif line.startswith("data:") and event == "image_generation.partial_image":
                    partials.append(round(now, 3))
                elif line.startswith("data:") and event == "image_generation.completed":
                    images.append(round(now, 3))
                elif line.startswith("data:") and event == "error":
                    raise SystemExit(f"the stream failed: {line}")
    finally:
        stack.stop()
    return {
        "size": f"{size}x{size}", "steps": steps, "services_start_s": round(startup_s, 1),
        "unstreamed_s": round(unstreamed_s, 3),
        **{key: round(value, 4) for key, value in marks.items()},
        "partial_images_s": partials, "images_s": images,
        "services_timings_ms": None if summary is None else summary["timings"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preview_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--points", default="1024:50", help="size:steps, comma-separated (in-process part)")
    parser.add_argument("--guidance", type=float, default=9.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-stack", action="store_true", help="skip the streamed request through the services")
    parser.add_argument("--stack-point", default="1024:50", help="size:steps of the streamed request")
    parser.add_argument("--tiny", action="store_true", help="dry run on the tiny model (with --device cpu)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ardit-preview-cost"))
    args = parser.parse_args(argv)
    import torch

    tiny_dir = None
    if args.tiny:
        from bench.services import make_model_dir

        tiny_dir = make_model_dir(args.workdir, tiny=True)
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "model": "tiny" if args.tiny else "Preview-shaped DiT stage, random bf16 weights",
        "inprocess": inprocess(_parse_points(args.points), args.guidance, args.repeats, args.device, tiny_dir),
    }
    if not args.no_stack:
        (size, steps), = _parse_points(args.stack_point)
        report["stream"] = stream_through_services(size, steps, args.guidance, args.workdir, args.workdir / "logs",
                                                   args.device, args.tiny)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
