"""What FP8 costs in fidelity and buys in speed, on Preview-shaped random weights (one H200, ~3-5 minutes).

    python -m bench.fp8_check --out $OUT/fp8_check.json [--markdown $OUT/fp8_check.md]
    python -m bench.fp8_check --tiny --out fp8_tiny.json    # the tiny model on the CPU: fidelity parts only

Parts (each recorded on its own; a part that fails leaves its error in the JSON and the rest still run):

- ``ar_layers``: every AR linear FP8 covers (``ar_service/model/quantize.py``), output relative L2 error of the
  weight-only FP8 product against bf16 on random bf16 inputs, by role (mean and worst over the layers);
- ``ar_prefill``: a prompt's final hidden states and generation logits, FP8 model against bf16, and the prefill's
  wall time both ways (FP8 prefill dequantizes each weight for its matmul);
- ``ar_decode``: one decode step's GPU time at one row (ms/token at concurrency 1) with the decoder ar_service
  runs by default (fixed slots, triton kernels, CUDA graph), bf16 against FP8, at two cache lengths;
- ``dit_layers``: every DiT block linear, FP8 matmul (per-token activation scales) against bf16, by role;
- ``dit_velocity``: one guided velocity at 1024x1024 (packed CFG, as bench/cfg_modes_check): FP8 against bf16,
  next to bf16's own distance from float32 (same weights, cast up);
- ``dit_step``: one guided denoise step (CUDA graphs, as dit_service) at 512 and 1024, bf16 against FP8, ratio;
- ``image``: one fixed-seed 1024x1024 render of the DiT stage (same conditions, 50 steps, VAE decode), bf16 against
  FP8: PSNR of the two images. The AR is left out of the pair on purpose: with random weights, the AR's sampled
  tokens part ways after a few tokens under any perturbation, which says nothing about the image quality of a
  trained model; the AR's own fidelity is ``ar_layers`` and ``ar_prefill``.

Random weights (normal, as the services' ``--random-weights``) have no outlier channels: a trained checkpoint's
per-channel errors can be larger where a few weights dominate a channel.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

from bench.markdown import lookup
from bench.report import emit
from bench.timing import median_ms

#: The FP8 targets (measured by this benchmark: the step times, not the end-to-end latency).
AR_MS_PER_TOKEN_TARGET = 2.1
DIT_SPEEDUP_TARGET = 1.5
#: Timed prefills per precision (after one untimed): the figure is their median.
PREFILL_REPEATS = 7


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of ``a`` from ``b`` (computed in float32)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def psnr(a, b) -> float:
    """PSNR in dB of two uint8 images (inf when equal)."""
    mse = float(((torch.as_tensor(a).double() - torch.as_tensor(b).double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _part(report: dict, name: str, fn: Callable[[], dict]) -> None:
    """Runs one part, records its result or its error, and goes on."""
    started = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as error:  # recorded, not raised: the other parts still run
        report[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
    report[name]["seconds"] = round(time.perf_counter() - started, 2)
    print(name, "done in", report[name]["seconds"], "s", "(error)" if "error" in report[name] else "", flush=True)


def _by_role(errors: list[tuple[str, float]]) -> dict:
    """{role: {mean, max, count}} from (dotted layer name, error) pairs; the role is the name after the index."""
    roles: dict[str, list[float]] = {}
    for name, error in errors:
        parts = name.split(".")
        index = min((i for i, p in enumerate(parts) if p.isdigit()), default=-1)  # the block's index
        role = ".".join(parts[index + 1:]) if index >= 0 else name
        group = parts[0] if parts[0] != "model" else "layers"
        roles.setdefault(f"{group}:{role}" if index >= 0 else role, []).append(error)
    return {role: {"mean": sum(v) / len(v), "max": max(v), "count": len(v)} for role, v in sorted(roles.items())}


def linear_errors(model: torch.nn.Module, names: list[str], rows: int, dynamic: bool, seed: int = 0) -> list:
    """(name, relative error of the FP8 product against the bf16 one) for each named nn.Linear, on random inputs."""
    from servicekit.fp8 import FP8Linear

    generator = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, torch.nn.Linear)
        x = torch.randn(rows, linear.in_features, generator=generator).to(linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            ref = F.linear(x, linear.weight)
            got = FP8Linear(linear, "dynamic" if dynamic else "weight_only")
            got.bias = None  # type: ignore[assignment]  # compared against the product without bias
            out.append((name, rel(got(x), ref)))
        del got
    return out


# -- the AR ----------------------------------------------------------------------------------------------------------


class ARBench:
    def __init__(self, tiny: bool, device: torch.device, dtype: torch.dtype):
        from ar_service.model.loading import load_ar
        from ar_service.model.tiny import write_ar_only_root

        root = write_ar_only_root(Path(tempfile.mkdtemp()) / "ar", preview=not tiny, weights=tiny)
        self.loaded = load_ar(root, device=device, dtype=dtype, random_weights=not tiny)
        self.device, self.tiny = device, tiny
        generator = torch.Generator().manual_seed(1)
        vocab = self.loaded.config.vocab_size
        self.prompt = torch.randint(0, min(vocab, 150_000), (1, 64 if tiny else 160), generator=generator).to(device)
        self.bf16_prefill: tuple | None = None

    def layers(self) -> dict:
        from ar_service.model.quantize import fp8_linear_names

        model = self.loaded.model
        errors = linear_errors(model, fp8_linear_names(model), rows=16, dynamic=False)
        return {"rows": 16, "by_role": _by_role(errors), "worst": max(errors, key=lambda e: e[1])}

    @torch.no_grad()
    def _prefill(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        ms, (logits, hidden) = median_ms(lambda: self.loaded.model(self.prompt, num_logits=1), self.device,
                                         PREFILL_REPEATS)
        start = self.loaded.config.gen_vocab_start_index
        return hidden, logits[:, -1, start:], ms

    def prefill_bf16(self) -> dict:
        self.bf16_prefill = self._prefill()
        return {}

    def quantize(self) -> dict:
        from ar_service.model.quantize import quantize_ar_

        quantize_ar_(self.loaded.model)
        return {}

    def prefill_fp8(self) -> dict:
        if self.bf16_prefill is None:
            raise RuntimeError("the bf16 prefill did not run")
        hidden, logits, ms = self._prefill()
        ref_hidden, ref_logits, ref_ms = self.bf16_prefill
        top = ref_logits.float().topk(50).indices
        return {
            "prompt_tokens": int(self.prompt.shape[1]),
            "hidden_rel_err": rel(hidden, ref_hidden), "gen_logits_rel_err": rel(logits, ref_logits),
            "top50_gen_overlap": len(set(top[0].tolist()) & set(logits.float().topk(50).indices[0].tolist())) / 50,
            "bf16_ms": ref_ms, "fp8_ms": ms, "fp8_over_bf16": ms / ref_ms,
        }

    def decode_ms(self, positions: list[int]) -> dict:
        """GPU time of one captured decode step at one row (the services' default decoder), per cache length."""
        from ar_service.decoding.decoders import ROWS_PER_IMAGE
        from ar_service.model.static_decode import StaticDecoder, resolve_decode_kernels
        from ar_service.settings import ARSettings
        from bench.decode_profile import step_ms

        model = self.loaded.model
        slots = ROWS_PER_IMAGE * ARSettings.model_fields["max_batch_size"].default
        fp8 = any(hasattr(m, "weight_scale") for m in model.modules())
        kernels = resolve_decode_kernels("auto", self.device, slots, model.dtype, fp8=fp8)
        static = StaticDecoder(model, slots, max(positions) + 64, compile=True, kernels=kernels)
        result = {"kernels": kernels, "ms_per_token": {str(p): step_ms(static, 1, p) for p in positions}}
        del static
        torch.cuda.empty_cache()
        return result


B = TypeVar("B")


def _build(report: dict, name: str, make: Callable[[], B], model: Callable[[B], torch.nn.Module]) -> B | None:
    """A bench built as the part ``name`` (its parameter count recorded); None when building it failed."""
    built: list[B] = []

    def build() -> dict:
        built.append(make())
        return {"parameters": sum(p.numel() for p in model(built[0]).parameters())}

    _part(report, name, build)
    return built[0] if built else None


def run_ar(report: dict, tiny: bool, device: torch.device, dtype: torch.dtype) -> None:
    ar = _build(report, "ar_build", lambda: ARBench(tiny, device, dtype), lambda b: b.loaded.model)
    if ar is None:
        return
    _part(report, "ar_layers", ar.layers)
    positions = [700, 2200]
    decode: dict = {"positions": positions}
    if device.type == "cuda":
        _part(decode, "bf16", lambda: ar.decode_ms(positions))
    _part(report, "ar_prefill_bf16", ar.prefill_bf16)
    _part(report, "ar_quantize", ar.quantize)
    _part(report, "ar_prefill", ar.prefill_fp8)
    if device.type == "cuda":
        _part(decode, "fp8", lambda: ar.decode_ms(positions))
        try:
            decode["fp8_over_bf16"] = {p: decode["fp8"]["ms_per_token"][p] / decode["bf16"]["ms_per_token"][p]
                                       for p in decode["bf16"]["ms_per_token"]}
        except (KeyError, ZeroDivisionError):
            pass
        report["ar_decode"] = decode
    else:
        report["ar_decode"] = {"skipped": "needs CUDA (the step's GPU time)"}


# -- the DiT ---------------------------------------------------------------------------------------------------------


class DiTBench:
    def __init__(self, tiny: bool, device: torch.device, dtype: torch.dtype, seed: int = 0):
        from dit_service.model.pipeline import DiTPipeline, preview_dit_config
        from dit_service.model.tiny import tiny_gen_parts

        if tiny:
            parts, _ = tiny_gen_parts(64)
            config = dict(parts, llm_config={"text_config": {"hidden_size": 64}})
        else:
            config = preview_dit_config()
        self.pipeline = DiTPipeline.from_config(config, device=device, dtype=dtype, random_weights=True, seed=seed)
        self.device, self.dtype, self.tiny = device, dtype, tiny
        self.sizes = [64, 128] if tiny else [512, 1024]
        self.image_size = 128 if tiny else 1024
        self.image_steps = 4 if tiny else 50
        generator = torch.Generator().manual_seed(0)
        dim = self.pipeline.condition_dim
        self.conditions = {}
        for size in sorted({*self.sizes, self.image_size}):
            grid = size // 16
            self.conditions[size] = (torch.randn(77, dim, generator=generator),
                                     torch.randn(grid * (grid + 1), dim, generator=generator))
        self.empty = torch.zeros(0, dim)
        self.images: dict[str, object] = {}

    def layers(self) -> dict:
        from dit_service.model.transformer import BLOCK_FP8_LINEARS

        dit = self.pipeline.transformer
        names = [f"{group}.{i}.{leaf}" for group in ("context_refiner", "noise_refiner", "layers")
                 for i in range(len(getattr(dit, group))) for leaf in BLOCK_FP8_LINEARS]
        errors = linear_errors(dit, names, rows=64 if self.tiny else 1024, dynamic=True)
        return {"rows": 64 if self.tiny else 1024, "by_role": _by_role(errors), "worst": max(errors, key=lambda e: e[1])}

    @torch.no_grad()
    def velocity(self, transformer, dtype: torch.dtype, guidance: float = 9.0) -> torch.Tensor:
        """The guided velocity at the largest size (packed CFG), float32, from fixed inputs."""
        from dit_service.model.sampler import pack_conditions

        size = self.sizes[-1]
        text, image = self.conditions[size]
        cond = self.pipeline.assemble_condition(text, image).to(dtype)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(1, self.pipeline.latent_channels, size // 8, size // 8, generator=generator)
        x, t = x.to(self.device, dtype), torch.tensor([0.5], device=self.device, dtype=dtype)
        packed, lengths = pack_conditions([cond, self.empty.to(cond)])
        both = transformer(x.expand(2, -1, -1, -1), t.expand(2), packed, lengths).float()
        c, u = both[:1], both[1:]
        return u + guidance * (c - u)

    def entry(self, size: int):
        """A guided 50-step render of ``size`` from the fixed conditions, ready for its first step."""
        text, image = self.conditions[size]
        return self.pipeline.start_entry(text, image, self.empty, size, size, seed=0, steps=50, guidance=9.0)

    def step_ms(self, steps: int = 6) -> dict:
        """Mean wall time of a guided denoise step (after eager, capture and replay warm-up steps), per size."""
        self.pipeline.use_cuda_graphs(8)  # a fresh set of graphs for the weights the transformer has now
        out = {}
        for size in self.sizes:
            entry = self.entry(size)
            for _ in range(3):
                self.pipeline.step([entry])
            self.pipeline.synchronize()
            started = time.perf_counter()
            for _ in range(steps):
                self.pipeline.step([entry])
            self.pipeline.synchronize()
            out[str(size)] = (time.perf_counter() - started) * 1e3 / steps
        return out

    @torch.no_grad()
    def image(self, name: str) -> dict:
        text, image = self.conditions[self.image_size]
        size = self.image_size
        self.pipeline.use_cuda_graphs(8 if self.device.type == "cuda" else 0)
        entry = self.pipeline.start_entry(text, image, self.empty, size, size, seed=1234, steps=self.image_steps,
                                          guidance=9.0)
        started = time.perf_counter()
        while not entry.done:
            self.pipeline.step([entry])
        pixels = self.pipeline.decode(entry.latents)
        self.images[name] = pixels
        return {"size": size, "steps": self.image_steps, "seconds": time.perf_counter() - started}

    def quantize(self) -> dict:
        self.pipeline.quantize("fp8")
        from servicekit.fp8 import FP8Linear

        return {"fp8_linears": sum(isinstance(m, FP8Linear) for m in self.pipeline.transformer.modules())}


def run_dit(report: dict, tiny: bool, device: torch.device, dtype: torch.dtype) -> None:
    dit = _build(report, "dit_build", lambda: DiTBench(tiny, device, dtype), lambda b: b.pipeline.transformer)
    if dit is None:
        return
    velocities: dict[str, torch.Tensor] = {}
    step: dict = {}
    _part(report, "dit_layers", dit.layers)

    def velocity_bf16() -> dict:
        velocities["bf16"] = dit.velocity(dit.pipeline.transformer, dtype)
        return {}

    def velocity_fp32() -> dict:
        dit32 = copy.deepcopy(dit.pipeline.transformer).float()
        velocities["fp32"] = dit.velocity(dit32, torch.float32)
        del dit32
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {}

    _part(report, "dit_velocity_bf16", velocity_bf16)
    _part(report, "dit_velocity_fp32", velocity_fp32)
    if device.type == "cuda":
        _part(step, "bf16", lambda: {"ms": dit.step_ms()})
    _part(report, "image_bf16", lambda: dit.image("bf16"))
    _part(report, "dit_quantize", dit.quantize)

    def velocity_fp8() -> dict:
        v = dit.velocity(dit.pipeline.transformer, dtype)
        out = {"size": dit.sizes[-1], "guidance": 9.0}
        if "bf16" in velocities:
            out["rel_err_fp8_vs_bf16"] = rel(v, velocities["bf16"])
        if "fp32" in velocities:
            out["rel_err_fp8_vs_fp32"] = rel(v, velocities["fp32"])
            if "bf16" in velocities:
                out["rel_err_bf16_vs_fp32"] = rel(velocities["bf16"], velocities["fp32"])
                out["fp8_error_over_bf16_error"] = out["rel_err_fp8_vs_fp32"] / out["rel_err_bf16_vs_fp32"]
        return out

    _part(report, "dit_velocity", velocity_fp8)
    if device.type == "cuda":
        _part(step, "fp8", lambda: {"ms": dit.step_ms()})
        try:
            step["bf16_over_fp8"] = {s: step["bf16"]["ms"][s] / step["fp8"]["ms"][s] for s in step["bf16"]["ms"]}
        except (KeyError, ZeroDivisionError):
            pass
        report["dit_step"] = step
    else:
        report["dit_step"] = {"skipped": "needs CUDA (CUDA graphs, GPU time)"}
    _part(report, "image_fp8", lambda: dit.image("fp8"))

    def compare() -> dict:
        if not {"bf16", "fp8"} <= set(dit.images):
            raise RuntimeError("one of the two images is missing")
        return {"size": dit.image_size, "steps": dit.image_steps, "seed": 1234,
                "psnr_db": psnr(dit.images["bf16"], dit.images["fp8"])}

    _part(report, "image", compare)


# -- summary ---------------------------------------------------------------------------------------------------------


def _f(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown(report: dict) -> str:
    """The run as a short page: targets with pass/fail, fidelity tables, errors."""
    lines = [f"# FP8 check ({report.get('device', '?')}, torch {report.get('torch', '?')})", ""]
    lines += ["| what | bf16 | fp8 | ratio | target | verdict |", "| --- | --- | --- | --- | --- | --- |"]
    ar = lookup(report, "ar_decode", default={})
    for p in lookup(ar, "positions", default=[]):
        b, f = lookup(ar, "bf16", "ms_per_token", str(p)), lookup(ar, "fp8", "ms_per_token", str(p))
        verdict = "-" if f is None else ("pass" if f <= AR_MS_PER_TOKEN_TARGET else "fail")
        ratio = None if b is None or f is None else f / b
        lines.append(f"| AR decode step, 1 row @ {p} positions (ms) | {_f(b)} | {_f(f)} | {_f(ratio, 3)} | "
                     f"<= {AR_MS_PER_TOKEN_TARGET} | {verdict} |")
    step = lookup(report, "dit_step", default={})
    for size in lookup(step, "bf16", "ms", default={}) or {}:
        b, f = step["bf16"]["ms"][size], lookup(step, "fp8", "ms", size)
        speedup = None if f is None else b / f
        target = f">= {DIT_SPEEDUP_TARGET}x" if size == "1024" else "-"
        verdict = "-" if speedup is None or size != "1024" else ("pass" if speedup >= DIT_SPEEDUP_TARGET else "fail")
        lines.append(f"| DiT guided denoise step {size}x{size} (ms) | {_f(b)} | {_f(f)} | {_f(speedup, 3)}x faster | "
                     f"{target} | {verdict} |")
    prefill = lookup(report, "ar_prefill", default={})
    if "bf16_ms" in prefill:
        lines.append(f"| AR prefill, {prefill['prompt_tokens']} tokens (ms) | {_f(prefill['bf16_ms'])} | "
                     f"{_f(prefill['fp8_ms'])} | {_f(prefill['fp8_over_bf16'], 3)} | - | - |")
    lines += ["", "## Fidelity", "", "| measure | value |", "| --- | --- |"]
    velocity = lookup(report, "dit_velocity", default={})
    for key in ("rel_err_fp8_vs_bf16", "rel_err_bf16_vs_fp32", "rel_err_fp8_vs_fp32", "fp8_error_over_bf16_error"):
        if key in velocity:
            lines.append(f"| DiT guided velocity {key} | {_f(velocity[key])} |")
    for key in ("hidden_rel_err", "gen_logits_rel_err", "top50_gen_overlap"):
        if key in prefill:
            lines.append(f"| AR prefill {key} | {_f(prefill[key])} |")
    if "psnr_db" in lookup(report, "image", default={}):
        image = report["image"]
        lines.append(f"| image PSNR bf16 vs fp8, {image['size']}x{image['size']}, {image['steps']} steps, seed "
                     f"{image['seed']} (dB) | {_f(image['psnr_db'])} |")
    for part in ("ar_layers", "dit_layers"):
        roles = lookup(report, part, "by_role")
        if roles:
            lines += ["", f"### {part}: output relative error of each linear, fp8 vs bf16", "",
                      "| role | mean | max | layers |", "| --- | --- | --- | --- |"]
            lines += [f"| {role} | {_f(v['mean'])} | {_f(v['max'])} | {v['count']} |" for role, v in roles.items()]
    errors = [(name, value["error"]) for name, value in report.items() if isinstance(value, dict) and "error" in value]
    errors += [(f"{name}.{k}", v["error"]) for name, value in report.items() if isinstance(value, dict)
               for k, v in value.items() if isinstance(v, dict) and "error" in v]
    if errors:
        lines += ["", "## Parts that failed", ""] + [f"- {name}: {error}" for name, error in errors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON report")
    parser.add_argument("--markdown", type=Path, help="summary page (default: the --out path with .md)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (fidelity parts only)")
    parser.add_argument("--parts", default="ar,dit", help="ar, dit or both")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "tiny": args.tiny}
    started = time.perf_counter()
    torch.manual_seed(0)
    if "ar" in args.parts:
        run_ar(report, args.tiny, device, dtype)
        gc.collect()  # the AR's weights go before the DiT's come
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "dit" in args.parts:
        run_dit(report, args.tiny, device, dtype)
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    if device.type == "cuda":
        report["peak_gpu_mib"] = torch.cuda.max_memory_reserved() // 2**20
    emit(report, args.out)
    page = markdown(report)
    target = args.markdown or (args.out.with_suffix(".md") if args.out else None)
    if target is not None:
        target.write_text(page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
