"""What an answered PNG's zlib level costs: encode time on this host's CPU and file size, per level, per picture,
for dit_service's encoder (``dit_service.png``, deflating on several cores) and Pillow's beside it.

    python -m bench.png_levels [--size 1024] [--levels 0,1,3,6,9] [--repeats 5] [--out FILE]

The encode runs on dit_service's host CPU after every image (``encode_ms`` in the answer's timings), so the level
(dit_service ``png_compress_level``) trades latency against bytes on the wire. Two pictures, both ``--size``
square: "smooth", a 32x32 random picture enlarged bicubically with +-3 grain (the long gradients and fine noise of
a photograph or a trained model's render), and "noise", uniform random pixels (what random weights can draw;
zlib cannot shrink it at any level). Pixels are the same at every level: PNG is lossless.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.report import emit
from dit_service.imaging import PNG_COMPRESS_LEVEL, encode_image


def pictures(size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    small = (rng.random((32, 32, 3)) * 255).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC)).astype(np.int16)
    smooth = np.clip(smooth + rng.integers(-3, 4, smooth.shape), 0, 255).astype(np.uint8)
    noise = (rng.random((size, size, 3)) * 255).astype(np.uint8)
    return {"smooth": smooth, "noise": noise}


def pillow_png(pixels: np.ndarray, level: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=level)
    return out.getvalue()


ENCODERS = {"ardit": lambda pixels, level: encode_image(pixels, "png", png_level=level), "pillow": pillow_png}


def measure(pixels: np.ndarray, level: int, repeats: int, encoder: str = "ardit") -> dict:
    times, data = [], b""
    for _ in range(repeats):
        started = time.perf_counter()
        data = ENCODERS[encoder](pixels, level)
        times.append((time.perf_counter() - started) * 1e3)
    return {"encode_ms": round(statistics.median(times), 1), "kib": round(len(data) / 1024)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.png_levels", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--levels", default="0,1,3,6,9")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    levels = [int(level) for level in args.levels.split(",")]
    report: dict = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "size": args.size, "default_level": PNG_COMPRESS_LEVEL,
                    "pictures": {}, "pillow": {}}
    for name, pixels in pictures(args.size).items():
        report["pictures"][name] = {str(level): measure(pixels, level, args.repeats) for level in levels}
        report["pillow"][name] = {str(level): measure(pixels, level, args.repeats, "pillow") for level in levels}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
