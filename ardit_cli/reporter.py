"""What the user sees and gets: progress bars on stderr (tqdm), the images and partial images written to files.

Two bars, each over all n images: the AR's grid rows and the DiT's denoising steps, fed by the progress events
(StreamImage over gRPC, ``: ardit.progress`` comments of a streaming gateway); on a stream that is not a terminal,
plain lines (``AR rows: 8/8``) instead.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

STAGE_LABELS = {"ar_decode": "AR rows", "denoise": "denoise steps"}



def image_path(output: Path, index: int, n: int) -> Path:
    """``output`` itself for one image; ``<stem>-<index><suffix>`` for each of several."""
    return output if n == 1 else output.with_name(f"{output.stem}-{index}{output.suffix}")


def preview_path(output: Path, index: int, n: int, partial_index: int) -> Path:
    """``<image stem>.partial<k><suffix>`` beside the image it previews."""
    final = image_path(output, index, n)
    return final.with_name(f"{final.stem}.partial{partial_index}{final.suffix}")


class ConsoleReporter:
    """Progress on ``stream``: tqdm bars on a terminal, plain lines otherwise (a log, a pipe, a CI job)."""

    LINE_INTERVAL_S = 1.0  # plain lines: at most one per bar per interval, and always the last

    def __init__(self, output: Path, n: int, show_progress: bool = True, stream: TextIO | None = None):
        self.output = output
        self.n = n
        self.show_progress = show_progress
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.bars: dict[str, tqdm] = {}
        self.totals: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.done: dict[tuple[str, int], int] = {}  # (stage, image) -> steps done
        self.last_line: dict[str, float] = {}
        self.written: list[tuple[Path, int, int, int]] = []  # path, seed, width, height
        self.previews: list[Path] = []
        self.summary: dict[str, Any] = {}
        self.started = time.monotonic()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # -- Reporter --------------------------------------------------------------------------------

    def progress(self, index: int, stage: str, step: int, total: int) -> None:
        if not self.show_progress or stage not in STAGE_LABELS:
            return
        before = self.done.get((stage, index), 0)
        if step <= before:
            return
        self.done[(stage, index)] = step
        self.totals.setdefault(stage, total * self.n)
        self.counts[stage] = self.counts.get(stage, 0) + step - before
        if self.interactive:
            bar = self.bars.get(stage)
            if bar is None:
                bar = self.bars[stage] = tqdm(
                    total=self.totals[stage], desc=STAGE_LABELS[stage], unit="row" if stage == "ar_decode" else "step",
                    file=self.stream, position=len(self.bars), leave=True, dynamic_ncols=True,
                )
            bar.update(step - before)
            return
        now, count, whole = time.monotonic(), self.counts[stage], self.totals[stage]
        if count >= whole or now - self.last_line.get(stage, -1e9) >= self.LINE_INTERVAL_S:
            self.last_line[stage] = now
            print(f"{STAGE_LABELS[stage]}: {count}/{whole}", file=self.stream, flush=True)

    def preview(self, index: int, partial_index: int, data: bytes) -> None:
        path = preview_path(self.output, index, self.n, partial_index)
        path.write_bytes(data)
        self.previews.append(path)

    def image(self, index: int, seed: int, data: bytes, width: int, height: int) -> None:
        path = image_path(self.output, index, self.n)
        path.write_bytes(data)
        self.written.append((path, seed, width, height))

    def completed(self, request_id: str, seed: int, timings: dict[str, Any]) -> None:
        self.summary = {"request_id": request_id, "seed": seed, "timings": timings}

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        for bar in self.bars.values():
            bar.close()
        if self.show_progress and not self.interactive and "ar_decode" not in self.counts and self.written:
            print(f"done in {time.monotonic() - self.started:.1f} s", file=self.stream, flush=True)

    def report(self, out: TextIO) -> None:
        """One line per file written, then the request id and the stage timings."""
        for path in self.previews:
            print(f"partial image {path}", file=out)
        for path, seed, width, height in sorted(self.written, key=lambda item: str(item[0])):
            print(f"wrote {path} ({width}x{height}, seed {seed})", file=out)
        timings = self.summary.get("timings") or {}
        if self.summary.get("request_id"):
            stages = ", ".join(
                f"{label} {timings[key]:.0f} ms" for key, label in
                (("ar_decode_ms", "AR decode"), ("denoise_ms", "denoise"), ("vae_decode_ms", "VAE decode"))
                if timings.get(key)
            )
            if timings.get("ar_grid_width") and timings.get("ar_grid_height"):
                grid = f"{timings['ar_grid_width']}x{timings['ar_grid_height']}-token grid"
                stages = f"{grid}, {stages}" if stages else grid
            total = f" in {timings['total_ms']:.0f} ms" if timings.get("total_ms") else ""
            print(f"request {self.summary['request_id']}{total}" + (f" ({stages})" if stages else ""), file=out)
