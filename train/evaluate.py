"""``python -m train.evaluate --url http://127.0.0.1:8000 -n 200``: held-out captions through the running
services (REST), each image scored by the detector; prints per-attribute and fully-correct rates.

The captions are the first ``n`` of a seeded draw over held-out scenes (their (shape, colour, position) triple
never occurs in training), so the same command always asks the same questions. With ``--edits`` it sends held-out
edits instead (``train.edits``): each source scene's picture and its instruction to ``/v1/images/edits``, the
answer scored against the target scene per edit kind (changed, kept, all).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import io
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
from PIL import Image

from train.detect import detect
from train.edits import EDIT_KINDS, EditExample, edit_scores, held_out_edit_examples
from train.shapes import IMAGE_SIZE, Example, examples, render, split_scenes

ATTRIBUTES = ("background", "shape", "colour", "position", "all")
EDIT_SCORES = ("changed", "kept", "all")
SIZE = f"{IMAGE_SIZE}x{IMAGE_SIZE}"


def held_out_examples(count: int, seed: int = 0) -> list[Example]:
    _, held = split_scenes()
    return examples(held, count, seed=random.Random(seed).randrange(2**31))


@dataclass(frozen=True)
class Generated:
    """One answered image: its pixels, the digest of the file as served, and the stage timings it reported."""

    image: np.ndarray
    digest: str
    timings: dict


def _generated(response: httpx.Response) -> Generated:
    response.raise_for_status()
    answer = response.json()
    data = base64.b64decode(answer["data"][0]["b64_json"])
    image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return Generated(image, hashlib.sha256(data).hexdigest(), answer.get("timings") or {})


def generate_one(client: httpx.Client, url: str, prompt: str, seed: int, knobs: dict) -> Generated:
    body = {"prompt": prompt, "size": SIZE, "seed": seed, "response_format": "b64_json", **knobs}
    return _generated(client.post(f"{url}/v1/images/generations", json=body))


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def edit_one(client: httpx.Client, url: str, picture: bytes, prompt: str, seed: int, knobs: dict) -> Generated:
    """One multipart edit; knobs are form fields, as text (JSON for what is not a string, which the gateway parses
    back)."""
    fields = {"prompt": prompt, "size": SIZE, "seed": str(seed), "response_format": "b64_json",
              **{k: v if isinstance(v, str) else json.dumps(v) for k, v in knobs.items()}}
    return _generated(client.post(f"{url}/v1/images/edits", files={"image": ("source.png", picture, "image/png")},
                                  data=fields))


def _answers(ask, count: int, concurrency: int, timeout_s: float) -> list[Generated]:
    """``ask(client, i)`` for i < count, ``concurrency`` at a time, in order."""
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda i: ask(client, i), range(count)))


def generate(client: httpx.Client, url: str, prompt: str, seed: int, knobs: dict) -> np.ndarray:
    return generate_one(client, url, prompt, seed, knobs).image


def evaluate(url: str, count: int, seed: int = 0, knobs: dict | None = None, concurrency: int = 2,
             timeout_s: float = 300.0) -> tuple[dict, list[dict]]:
    """(rates per attribute, one row per caption with its image's digest and timings)."""
    cases = held_out_examples(count, seed)
    answers = _answers(lambda client, i: generate_one(client, url, cases[i].caption, seed + i, knobs or {}),
                       len(cases), concurrency, timeout_s)
    rows = []
    for i, (case, answer) in enumerate(zip(cases, answers, strict=True)):
        found = detect(answer.image)
        rows.append({"caption": case.caption, "seed": seed + i, "expected": case.scene, "found": found,
                     "digest": answer.digest, "timings": answer.timings, **found.scores(case.scene)})
    return attribute_rates(rows), rows


def attribute_rates(rows: list[dict]) -> dict[str, float]:
    """How often each attribute, and all four, read as asked (a caption's scene, an edit's target)."""
    return {a: sum(r[a] for r in rows) / max(len(rows), 1) for a in ATTRIBUTES}


def evaluate_edits(url: str, count: int, seed: int = 0, knobs: dict | None = None, concurrency: int = 2,
                   timeout_s: float = 300.0) -> tuple[dict, list[dict]]:
    """(changed/kept/all rates per edit kind and "overall", one row per edit with its image's digest and timings)."""
    cases: list[EditExample] = held_out_edit_examples(count, seed)
    answers = _answers(lambda client, i: edit_one(client, url, png(render(cases[i].edit.source)), cases[i].instruction,
                                                  seed + i, knobs or {}), len(cases), concurrency, timeout_s)
    rows = []
    for i, (case, answer) in enumerate(zip(cases, answers, strict=True)):
        found = detect(answer.image)
        rows.append({"caption": case.instruction, "kind": case.edit.kind, "seed": seed + i, "source": case.edit.source,
                     "expected": case.edit.target, "found": found, "size": f"{answer.image.shape[1]}x{answer.image.shape[0]}",
                     "digest": answer.digest, "timings": answer.timings, **found.scores(case.edit.target),
                     **edit_scores(found, case.edit)})
    groups = {kind: [r for r in rows if r["kind"] == kind] for kind in EDIT_KINDS} | {"overall": rows}
    rates = {group: {"count": len(members), **{s: sum(r[s] for r in members) / max(len(members), 1)
                                               for s in EDIT_SCORES}}
             for group, members in groups.items()}
    return rates, rows


def decode_speed(rows: list[dict]) -> dict:
    """What the AR spent per image, from the timings each answer carried: forwards, visual tokens, tokens per
    forward (total over total) and decode milliseconds (median). Empty when the service reports no forwards."""
    timings = [r["timings"] for r in rows if r["timings"].get("ar_forwards")]
    if not timings:
        return {}
    forwards = sum(t["ar_forwards"] for t in timings)
    tokens = sum(t["ar_tokens"] for t in timings)
    return {"images": len(timings), "forwards_per_image": forwards / len(timings),
            "tokens_per_image": tokens / len(timings), "tokens_per_forward": tokens / forwards,
            "ar_decode_ms_median": statistics.median(t["ar_decode_ms"] for t in timings),
            "total_ms_median": statistics.median(t["total_ms"] for t in timings)}


def speed_line(speed: dict) -> str:
    if not speed:
        return "AR: the service reported no forward counts"
    return (f"AR: {speed['forwards_per_image']:.1f} forwards per image for {speed['tokens_per_image']:.1f} tokens "
            f"({speed['tokens_per_forward']:.2f} tokens per forward), decode {speed['ar_decode_ms_median']:.0f} ms "
            f"and total {speed['total_ms_median']:.0f} ms per image (medians)")


def report(rates: dict, rows: list[dict], knobs: dict) -> dict:
    """What ``--json`` writes: the knobs, the rates, the AR speed and every image's seed and digest (two runs
    that served the same files have the same digests)."""
    return {"knobs": knobs, "count": len(rows), "rates": rates, "speed": decode_speed(rows),
            "images": [{"seed": r["seed"], "caption": r["caption"], "digest": r["digest"], "all": r["all"],
                        "found": dataclasses.asdict(r["found"]), **{k: r[k] for k in ("kind", "size") if k in r}}
                       for r in rows]}


def table(rates: dict, count: int) -> str:
    lines = ["| attribute | correct |", "| --- | --- |"]
    lines += [f"| {a if a != 'all' else 'all four (fully correct)'} | {rates[a]:.1%} ({round(rates[a] * count)}/{count}) |"
              for a in ATTRIBUTES]
    return "\n".join(lines)


def edit_table(rates: dict) -> str:
    """Rows: the edit kinds and overall; columns: the asked-for attribute changed, the others kept, all four right."""
    lines = ["| edit | " + " | ".join(EDIT_SCORES) + " |", "| --- | " + " | ".join("---" for _ in EDIT_SCORES) + " |"]
    for group, got in rates.items():
        n = got["count"]
        lines.append(f"| {group} | " + " | ".join(f"{got[s]:.1%} ({round(got[s] * n)}/{n})" for s in EDIT_SCORES) + " |")
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
    p.add_argument("-n", type=int, default=200, help="held-out captions (or edits) to send")
    p.add_argument("--edits", action="store_true", help="send held-out edits to /v1/images/edits instead")
    p.add_argument("--seed", type=int, default=0, help="picks the captions; image i uses seed + i")
    add_knob_options(p)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--show-failures", type=int, default=10, help="print up to this many wrong images' details")
    p.add_argument("--json", metavar="PATH", help="also write the rates, the AR speed and each image's digest here")
    args = p.parse_args(argv)
    knobs = knobs_from(args)
    started = time.monotonic()
    if args.edits:
        rates, rows = evaluate_edits(args.url, args.n, args.seed, knobs, args.concurrency)
        sections = [edit_table(rates), table(attribute_rates(rows), args.n), speed_line(decode_speed(rows)),
                    outline_table(rows)]
    else:
        rates, rows = evaluate(args.url, args.n, args.seed, knobs, args.concurrency)
        sections = [table(rates, args.n), speed_line(decode_speed(rows)), outline_table(rows)]
    print(f"{args.n} held-out {'edits' if args.edits else 'captions'} through {args.url} "
          f"(knobs {knobs or 'service defaults'}, {time.monotonic() - started:.0f} s)\n")
    print("\n\n".join(sections))
    failures = [r for r in rows if not r["all"]][: args.show_failures]
    if failures:
        print("\nsome wrong ones:")
        for r in failures:
            source = f"from {r['source']}, " if "source" in r else ""
            print(f"  {r['caption']!r}: {source}expected {r['expected']}, found {r['found']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report(rates, rows, knobs), out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
