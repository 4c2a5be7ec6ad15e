"""``python -m train.evaluate --url http://127.0.0.1:8000 -n 200``: held-out captions through the running
services (REST), each image scored by the detector; prints per-attribute and fully-correct rates.

The captions are the first ``n`` of a seeded draw over held-out scenes (their (shape, colour, position) triple
never occurs in training), so the same command always asks the same questions.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
from PIL import Image

from train.detect import detect
from train.shapes import IMAGE_SIZE, Example, examples, split_scenes

ATTRIBUTES = ("background", "shape", "colour", "position", "all")


def held_out_examples(count: int, seed: int = 0) -> list[Example]:
    _, held = split_scenes()
    return examples(held, count, seed=random.Random(seed).randrange(2**31))


def generate(client: httpx.Client, url: str, prompt: str, seed: int, knobs: dict) -> np.ndarray:
    body = {"prompt": prompt, "size": f"{IMAGE_SIZE}x{IMAGE_SIZE}", "seed": seed, "response_format": "b64_json", **knobs}
    response = client.post(f"{url}/v1/images/generations", json=body)
    response.raise_for_status()
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def evaluate(url: str, count: int, seed: int = 0, knobs: dict | None = None, concurrency: int = 2,
             timeout_s: float = 300.0) -> tuple[dict, list[dict]]:
    """(rates per attribute, one row per caption)."""
    cases = held_out_examples(count, seed)
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
        images = list(pool.map(lambda ic: generate(client, url, ic[1].caption, seed + ic[0], knobs or {}), enumerate(cases)))
    rows = []
    for case, image in zip(cases, images, strict=True):
        found = detect(image)
        rows.append({"caption": case.caption, "expected": case.scene, "found": found, **found.scores(case.scene)})
    rates = {a: sum(r[a] for r in rows) / max(len(rows), 1) for a in ATTRIBUTES}
    return rates, rows


def table(rates: dict, count: int) -> str:
    lines = ["| attribute | correct |", "| --- | --- |"]
    lines += [f"| {a if a != 'all' else 'all four (fully correct)'} | {rates[a]:.1%} ({round(rates[a] * count)}/{count}) |"
              for a in ATTRIBUTES]
    return "\n".join(lines)


def add_knob_options(p: argparse.ArgumentParser) -> None:
    """``--steps``, ``--guidance`` and any ``--knob NAME=VALUE``, read back by ``knobs_from``."""
    p.add_argument("--steps", type=int, help="num_inference_steps (default: the service's)")
    p.add_argument("--guidance", type=float, help="text_guidance_scale (default: the service's)")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="any other request knob, VALUE read as JSON when it parses (e.g. --knob top_k=64); repeatable")


def _knob(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--knob takes NAME=VALUE; got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def knobs_from(args: argparse.Namespace) -> dict:
    """The request knobs that ``--steps``, ``--guidance`` and ``--knob`` set (none: the service's defaults)."""
    knobs = dict(_knob(text) for text in args.knob)
    if args.steps is not None:
        knobs["num_inference_steps"] = args.steps
    if args.guidance is not None:
        knobs["text_guidance_scale"] = args.guidance
    return knobs


def outline_table(rows: list[dict]) -> str:
    """What the detector read for each asked-for outline: where the outline errors go."""
    shapes = sorted({r["expected"].shape for r in rows})
    found = sorted({r["found"].shape for r in rows} | set(shapes), key=str)
    lines = ["| asked for | right | " + " | ".join(f"read as {f or 'nothing'}" for f in found) + " |",
             "| --- | --- | " + " | ".join("---" for _ in found) + " |"]
    for shape in shapes:
        asked = [r for r in rows if r["expected"].shape == shape]
        right = sum(r["shape"] for r in asked)
        counts = [sum(r["found"].shape == f for r in asked) for f in found]
        lines.append(f"| {shape} | {right}/{len(asked)} | " + " | ".join(str(c) for c in counts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("-n", type=int, default=200, help="held-out captions to send")
    p.add_argument("--seed", type=int, default=0, help="picks the captions; image i uses seed + i")
    add_knob_options(p)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--show-failures", type=int, default=10, help="print up to this many wrong images' details")
    args = p.parse_args(argv)
    knobs = knobs_from(args)
    started = time.monotonic()
    rates, rows = evaluate(args.url, args.n, args.seed, knobs, args.concurrency)
    print(f"{args.n} held-out captions through {args.url} (knobs {knobs or 'service defaults'}, "
          f"{time.monotonic() - started:.0f} s)\n")
    print(table(rates, args.n))
    print()
    print(outline_table(rows))
    failures = [r for r in rows if not r["all"]][: args.show_failures]
    if failures:
        print("\nsome wrong ones:")
        for r in failures:
            print(f"  {r['caption']!r}: expected {r['expected']}, found {r['found']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
