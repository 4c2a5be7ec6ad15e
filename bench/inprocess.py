"""The same pipeline in one process: no gRPC, no gateway, no queue. The baseline the services are measured against.

For each request: tokenize the T2I prompt, prefill and decode the visual-token grid (``generate_grid``, batch of
one, with the shared system-prefix cache and the decode path ar_service uses by default: fixed slots with CUDA
graphs on CUDA, the eager decoder on the CPU; with AR guidance and the checkpoint's condition scope and visual
range as ar_service applies them), prefill the negative prompt as ar_service does (the model's default one, when
the DiT guides), hand the text and image conditions to the DiT
pipeline (``start_entry``: device copy, refiner), run the Euler steps (``step``, both guidance branches packed,
as dit_service runs a batch), VAE-decode and encode a PNG. The models are built the way the services build them
(``load_ar`` and ``DiTPipeline.from_checkpoint``, random weights for the Preview skeleton), on one device.

Timings carry the services' stage names (protos/common.proto ``StageTimings``) so the two can be put side by
side: ``condition_transfer_ms`` here is the condition hand-over inside the process (``start_entry``: device copy
and refiner); ``dit_queue_ms`` is 0 (there is no queue); ``total_ms`` is the wall clock of the request. The device
is synchronised at the end of the decode loop and of the denoise loop, so each stage holds its own device work.

``python -m bench.inprocess --model-dir DIR --points 512:20 [--random-weights] [--device cuda]`` runs it alone;
``bench.harness`` calls ``run`` after stopping the services.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ar_service.conditions import DecodeChoices, negative_prompt_ids, prompt_ids_for
from ar_service.decoding.decoders import ROWS_PER_IMAGE
from ar_service.generation import generate_grid
from ar_service.model.loading import LoadedAR, load_ar
from ar_service.prefill import PrefillMemo, build_prefix_cache, negative_condition_for, system_prefix_ids
from ar_service.prompt import GridRule
from ar_service.sampling import SamplingParams
from bench.timing import sync
from dit_service.imaging import encode_image
from dit_service.model.pipeline import DiTPipeline
from protos.knobs import FAMILIES
from servicekit.checkpoint import PipelineCheckpoint, open_checkpoint
from servicekit.devices import pick_device, pick_dtype

DECODERS = ("auto", "fast", "eager")
STAGES = ("ar_prefill_ms", "ar_decode_ms", "condition_transfer_ms", "dit_queue_ms", "denoise_ms", "vae_decode_ms",
          "encode_ms", "total_ms")


@dataclass
class InProcessPipeline:
    checkpoint: PipelineCheckpoint
    ar: LoadedAR
    dit: DiTPipeline
    device: torch.device
    load_s: float
    prefix_ids: list[int] | None = None
    prefix: object = None  # generation.PrefixCache: the system prefix, prefilled once (ar_service's default)
    decoder: object = None  # None: generate_grid's eager decoder; else a slot decoder as ar_service's fast_decode
    decoder_name: str = "eager"
    #: Repeated prefills kept by their ids, as ar_service's default ``prefill_memo``.
    memo: PrefillMemo = field(default_factory=PrefillMemo)

    @property
    def grid_rule(self) -> GridRule:
        """The checkpoint's grid rule, as ar_service's planner applies it."""
        return GridRule.of(self.checkpoint.serving)

    @classmethod
    def load(cls, model_dir: Path, device: str = "auto", dtype: str = "auto", random_weights: bool = False):
        checkpoint = open_checkpoint(model_dir, require_weights=not random_weights)
        torch_device = pick_device(device)
        torch_dtype = pick_dtype(dtype, torch_device)
        started = time.perf_counter()
        ar = load_ar(checkpoint, device=torch_device, dtype=torch_dtype, random_weights=random_weights)
        dit = DiTPipeline.from_checkpoint(checkpoint, device=torch_device, dtype=torch_dtype, random_weights=random_weights)
        from dit_service.settings import DiTSettings

        dit.use_cuda_graphs(DiTSettings.model_fields["cuda_graphs"].default)  # as dit_service by default
        sync(torch_device)
        prefix_ids = system_prefix_ids(ar.tokenizer)
        prefix = build_prefix_cache(ar.model, prefix_ids)
        return cls(checkpoint, ar, dit, torch_device, time.perf_counter() - started, prefix_ids, prefix)

    def use_decoder(self, mode: str, max_positions: int) -> None:
        """The AR decode path: ``auto`` as ar_service's ``--fast-decode auto`` (fixed slots with CUDA graphs on
        CUDA, the eager decoder on the CPU), ``fast`` or ``eager``. As many slots as ar_service's default
        ``max_batch_size`` gives it (a request decodes in the same step shapes as it does alone in the service), each
        sized for ``max_positions``."""
        if mode == "eager" or (mode == "auto" and self.device.type != "cuda"):
            self.decoder, self.decoder_name = None, "eager"
            return
        from ar_service.decoding.decoders import SlotDecoder
        from ar_service.model.static_decode import StaticDecoder, resolve_decode_kernels

        cuda = self.device.type == "cuda"
        from ar_service.settings import ARSettings

        fields = ARSettings.model_fields
        slots = ROWS_PER_IMAGE * fields["max_batch_size"].default
        kernels = resolve_decode_kernels(fields["decode_kernels"].default, self.device, slots, self.ar.model.dtype)
        static = StaticDecoder(self.ar.model, slots, max_positions, cuda_graphs=cuda, compile=cuda, kernels=kernels)
        self.decoder = SlotDecoder(static)
        self.decoder_name = f"fast ({kernels} kernels" + (", CUDA graphs, compiled)" if cuda else ")")

    def max_positions(self, prompt: str, sizes: list[int]) -> int:
        """Prompt + grid positions of the longest of these requests."""
        grids = [self.grid_rule.grid(s, s) for s in sizes]
        return max(len(prompt_ids_for(self.ar.tokenizer, prompt, grid)) + grid.decode_tokens for grid in grids)

    def knobs(self, steps: int, guidance: float | None = None, extra: dict | None = None) -> dict:
        """The knobs a service request with only ``num_inference_steps`` (and maybe guidance and ``extra`` knobs)
        resolves to."""
        table = FAMILIES[self.checkpoint.family]
        given = {"num_inference_steps": steps} | ({} if guidance is None else {"text_guidance_scale": guidance})
        given |= extra or {}
        ar = table.resolve({k: v for k, v in given.items() if k in table.names(("ar",))}, self.ar.t2i.sampling_defaults,
                           stages=("ar",))
        return {**ar, **table.resolve({k: v for k, v in given.items() if k in table.names(("dit",))}, {}, stages=("dit",))}

    @torch.inference_mode()
    def generate(self, prompt: str, size: int, steps: int, seed: int, guidance: float | None = None,
                 extra: dict | None = None) -> dict:
        """One image, start to PNG; returns the stage timings (ms) and the PNG's size."""
        knobs = self.knobs(steps, guidance, extra)
        choices = DecodeChoices.from_serving(self.ar.t2i, self.ar.config, self.ar.tokenizer, self.checkpoint.serving)
        model = self.ar.model
        started = time.perf_counter()
        grid = self.grid_rule.grid(size, size)
        prompt_ids = prompt_ids_for(self.ar.tokenizer, prompt, grid)
        sampling = SamplingParams(knobs["temperature"], knobs["top_k"], knobs["top_p"])
        decoder = {} if self.decoder is None else {"decoder": self.decoder}
        static = getattr(self.decoder, "static", None)
        if static is not None:
            static.device_timing, static.device_ms = True, 0.0
        uncond = torch.empty(0, model.config.hidden_size, dtype=model.dtype)
        negative_ms = 0.0
        if choices.default_negative_prompt.strip() and knobs["text_guidance_scale"] > 1.0:
            uncond, negative_ms = negative_condition_for(
                model, negative_prompt_ids(self.ar.tokenizer, choices.default_negative_prompt), self.prefix_ids, self.prefix,
                self.memo,
            )
        result = generate_grid(model, prompt_ids, grid, choices.t2i, sampling, seed,
                               prefix_ids=self.prefix_ids, prefix=self.prefix, guidance=knobs["ar_cfg_scale"],
                               condition_scope=choices.condition_scope, image_end_id=choices.image_end_id,
                               memo=self.memo, **decoder)
        sync(self.device)
        t_ar = time.perf_counter()
        entry = self.dit.start_entry(
            text_condition=result.text_condition, image_condition=result.image_condition, uncond_condition=uncond,
            width=size, height=size, seed=seed, steps=knobs["num_inference_steps"],
            guidance=knobs["text_guidance_scale"], cfg_range=tuple(knobs["cfg_range"]),
        )
        sync(self.device)
        t_condition = time.perf_counter()
        while not entry.done:
            self.dit.step([entry])
        sync(self.device)
        t_denoise = time.perf_counter()
        pixels = self.dit.decode(entry.latents)
        t_vae = time.perf_counter()
        png = encode_image(pixels, "png")
        t_end = time.perf_counter()
        return {
            "ar_prefill_ms": result.prefill_ms + negative_ms,
            "ar_decode_ms": result.decode_ms,
            # GPU time of the decode steps (upload + graph replay; CUDA only): against ar_decode_ms, the host's share
            "ar_decode_device_ms": static.device_ms if static is not None and static.device.type == "cuda" else None,
            "ar_tokens": len(result.token_ids),
            "condition_transfer_ms": (t_condition - t_ar) * 1e3,
            "dit_queue_ms": 0.0,
            "denoise_ms": (t_denoise - t_condition) * 1e3,
            "vae_decode_ms": (t_vae - t_denoise) * 1e3,
            "encode_ms": (t_end - t_vae) * 1e3,
            "total_ms": (t_end - started) * 1e3,
            "transformer_calls": entry.rows,
            "text_positions": int(result.text_condition.shape[0]),
            "image_positions": int(result.image_condition.shape[0]),
            "png_bytes": len(png),
        }


def run(
    model_dir: Path,
    points: list[tuple[int, int]],
    prompt: str,
    seed: int = 0,
    requests: int = 3,
    warmup: int = 1,
    device: str = "auto",
    random_weights: bool = False,
    guidance: float | None = None,
    decoder: str = "auto",
    knobs: dict | None = None,
) -> dict:
    """``requests`` measured images per (size, steps) point at concurrency 1, after ``warmup`` unmeasured ones."""
    pipeline = InProcessPipeline.load(model_dir, device=device, random_weights=random_weights)
    pipeline.use_decoder(decoder, pipeline.max_positions(prompt, [size for size, _ in points]))
    report = {"device": str(pipeline.device), "load_s": pipeline.load_s, "decoder": pipeline.decoder_name,
              "requests_per_point": requests, "points": []}
    for size, steps in points:
        for i in range(warmup):
            pipeline.generate(prompt, size, steps, seed + 100_000 + i, guidance, knobs)
        records = [pipeline.generate(prompt, size, steps, seed + i, guidance, knobs) for i in range(requests)]
        latencies = [r["total_ms"] / 1e3 for r in records]
        means = {key: statistics.fmean(r[key] for r in records) for key in (*STAGES, "ar_tokens", "transformer_calls")}
        means["ar_ms_per_token"] = statistics.fmean(r["ar_decode_ms"] / max(1, r["ar_tokens"]) for r in records)
        if all(r["ar_decode_device_ms"] is not None for r in records):
            means["ar_device_ms_per_token"] = statistics.fmean(
                r["ar_decode_device_ms"] / max(1, r["ar_tokens"]) for r in records)
        report["points"].append({
            "size": size, "steps": steps, "requests": records, "latency_s_mean": statistics.fmean(latencies),
            "stages_mean": means, "text_positions": records[0]["text_positions"],
            "image_positions": records[0]["image_positions"],
        })
    if pipeline.device.type == "cuda":
        report["peak_gpu_mib"] = torch.cuda.max_memory_reserved(pipeline.device) // 2**20
    del pipeline
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report


def parse_points(text: str) -> list[tuple[int, int]]:
    """"512:20,1024:50" -> [(512, 20), (1024, 50)]."""
    points = []
    for item in text.split(","):
        size, _, steps = item.strip().partition(":")
        if not size or not steps:
            raise argparse.ArgumentTypeError(f"a point is SIZE:STEPS (e.g. 512:20); got {item!r}")
        points.append((int(size), int(steps)))
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--points", type=parse_points, default=parse_points("512:20,1024:50"))
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--prompt", default="a photo of a red fox sitting in fresh snow, golden hour")
    parser.add_argument("--decoder", choices=DECODERS, default="auto",
                        help="AR decode path (auto: as ar_service's --fast-decode auto)")
    args = parser.parse_args(argv)
    report = run(args.model_dir, args.points, args.prompt, args.seed, args.requests, device=args.device,
                 random_weights=args.random_weights, decoder=args.decoder)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
