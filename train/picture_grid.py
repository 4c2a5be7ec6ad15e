"""``python -m train.picture_grid --url http://127.0.0.1:8000 --out docs/shapes_grid.png``: 16 held-out prompts
through the running services, drawn as a 4x4 grid of images with their prompts and the detector's verdict."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

from train.detect import detect
from train.evaluate import add_knob_options, generate, held_out_examples, knobs_from

COLUMNS = 4
CELL = 256  # each 128x128 image shown at twice its size
CAPTION_HEIGHT = 56


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--out", type=Path, default=Path("docs/shapes_grid.png"))
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("-n", type=int, default=16)
    add_knob_options(p)
    args = p.parse_args(argv)
    knobs = knobs_from(args)
    cases = held_out_examples(args.n, args.seed)
    rows = (len(cases) + COLUMNS - 1) // COLUMNS
    sheet = Image.new("RGB", (COLUMNS * CELL, rows * (CELL + CAPTION_HEIGHT)), "white")
    draw = ImageDraw.Draw(sheet)
    lines = []
    with httpx.Client(timeout=300) as client:
        for i, case in enumerate(cases):
            image = generate(client, args.url, case.caption, args.seed + i, knobs)
            ok = detect(image).scores(case.scene)["all"]
            x, y = (i % COLUMNS) * CELL, (i // COLUMNS) * (CELL + CAPTION_HEIGHT)
            sheet.paste(Image.fromarray(image).resize((CELL, CELL), Image.NEAREST), (x, y))
            text = textwrap.fill(case.caption, 40)
            draw.text((x + 4, y + CELL + 4), text, fill="black" if ok else (200, 0, 0))
            lines.append(f"{'ok ' if ok else 'WRONG'} {case.caption}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(args.out)
    print("\n".join(lines))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
