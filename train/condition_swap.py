"""``python -m train.condition_swap -n 100``: which half of the Dev condition a trained DiT draws from.

The Dev DiT's condition is [caption rows | Q-Former(image rows)] (``dev_stages.batched_context``). For each held-out
caption this draws three pictures in-process from the same noise, each scored by the detector:

- ``full``: the caption's own caption rows and image rows, as the services send them;
- ``image_only``: its image rows with no caption rows;
- ``swapped``: its caption rows with the image rows of the next held-out caption that asks for another shape.

Where the swapped picture's shape, colour and position come from says which half carries each attribute to the DiT,
and so where a miss of the outline has to be looked for. With ``--probe-train N`` it also fits linear probes for the
target's shape on N training captions' condition parts (the Q-Former's tokens, the image rows it reads, the caption
rows' mean) and scores them on the held-out captions: whether the shape is still in the condition the DiT gets.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from ar_service.generation import generate_grid
from ar_service.sampling import SamplingParams
from train import architecture
from train import dev_architecture as arch
from train.detect import Detection, detect
from train.dev_stages import Pool, Prompts, dev_conditions, finish, grid
from train.evaluate import held_out_examples
from train.shapes import SHAPES, Example, examples
from train.stages import training_scenes

ATTRIBUTES = ("shape", "colour", "position")


class Drawer:
    """The trained Dev modules of one checkpoint, drawing 128x128 pictures from (caption rows, image rows)."""

    def __init__(self, checkpoint: Path, steps: int, guidance: float) -> None:
        device = torch.device("cpu")
        self.ar, self.dit, vae, tok = arch.load(checkpoint, device)
        self.pipeline = arch.pipeline_for(self.dit, vae, device)
        self.prompts = Prompts(tok)
        self.grid = grid()
        self.size = self.grid.width * architecture.SERVING.pixels_per_token
        self.empty = torch.zeros(0, self.ar.config.hidden_size)
        self.steps, self.guidance = steps, guidance

    @torch.no_grad()
    def condition(self, caption: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(caption rows, image rows) of the AR's greedy grid, split as ar_service splits them for Dev."""
        result = generate_grid(self.ar, self.prompts.caption(caption), self.grid, architecture.t2i(),
                               SamplingParams(temperature=0.0), seed, **self.prompts.decode_kwargs())
        return result.text_condition, result.image_condition

    @torch.no_grad()
    def draw(self, text: torch.Tensor, image: torch.Tensor, seed: int) -> Detection:
        return detect(finish(self.pipeline, self.pipeline.start_entry(text, image, self.empty, self.size, self.size,
                                                                      seed, self.steps, self.guidance)))


def partner(captions: list[Example], i: int) -> int:
    """The next held-out caption (cyclically) whose scene asks for another shape than caption ``i``'s."""
    n = len(captions)
    return next(j % n for j in range(i + 1, i + n) if captions[j % n].scene.shape != captions[i].scene.shape)


def swap_rows(drawer: Drawer, captions: list[Example]) -> list[dict]:
    """One row per caption: what it asked for, what its image rows' caption asked for, and the three detections."""
    conditions = [drawer.condition(ex.caption, i) for i, ex in enumerate(captions)]
    rows = []
    for i, ex in enumerate(captions):
        j = partner(captions, i)
        text, image = conditions[i]
        drawn = {"full": drawer.draw(text, image, i), "image_only": drawer.draw(drawer.empty, image, i),
                 "swapped": drawer.draw(text, conditions[j][1], i)}
        rows.append({"caption": ex.caption, "asked": {a: getattr(ex.scene, a) for a in ATTRIBUTES},
                     "image_rows_asked": {a: getattr(captions[j].scene, a) for a in ATTRIBUTES},
                     **{k: {a: getattr(d, a) for a in ATTRIBUTES} for k, d in drawn.items()}})
    return rows


def summary(rows: list[dict]) -> dict:
    """Counts over the rows: full and image-only pictures right, and whose attribute each swapped picture shows."""
    out = {"captions": len(rows),
           "full_shape_right": sum(r["full"]["shape"] == r["asked"]["shape"] for r in rows),
           "image_only_shape_right": sum(r["image_only"]["shape"] == r["asked"]["shape"] for r in rows),
           "image_only_no_shape": sum(r["image_only"]["shape"] is None for r in rows)}
    for a in ATTRIBUTES:
        # Two captions can share a colour or a position: only those that differ say which half was followed.
        differ = [r for r in rows if r["asked"][a] != r["image_rows_asked"][a]]
        out[f"swapped_{a}"] = {"differing": len(differ),
                               "from_caption_rows": sum(r["swapped"][a] == r["asked"][a] for r in differ),
                               "from_image_rows": sum(r["swapped"][a] == r["image_rows_asked"][a] for r in differ)}
    out["swapped_shape_by_image_rows"] = {
        f"{k[0]} -> {k[1]}": v
        for k, v in sorted(Counter((r["image_rows_asked"]["shape"], str(r["swapped"]["shape"])) for r in rows).items())}
    return out


@torch.no_grad()
def condition_parts(drawer: Drawer, captions: list[Example]) -> dict[str, torch.Tensor]:
    """[captions, features] per condition part, teacher-forced on each scene's grid (the greedy grid, for a trained
    AR): the Q-Former's tokens and the image rows (flattened), the caption rows' mean."""
    conditions = dev_conditions(drawer.ar, Pool.build(drawer.prompts, captions, []), drawer.prompts, torch.device("cpu"))
    image = torch.stack([c[1] for c in conditions]).float()
    return {"qformer_tokens": drawer.dit.time_caption_embed.image_embedder(image).flatten(1),
            "image_rows": image.flatten(1), "caption_rows_mean": torch.stack([c[0].mean(0) for c in conditions])}


def shape_probes(drawer: Drawer, train: list[Example], held_out: list[Example], steps: int = 300) -> dict:
    """Held-out accuracy of a linear classifier of the target's shape fitted on each condition part of ``train``."""
    torch.manual_seed(0)
    labels = {split: torch.tensor([SHAPES.index(ex.scene.shape) for ex in exs])
              for split, exs in (("train", train), ("held_out", held_out))}
    fit, test = condition_parts(drawer, train), condition_parts(drawer, held_out)
    out = {}
    for part, x in fit.items():
        mean, std = x.mean(0), x.std(0) + 1e-6
        probe = torch.nn.Linear(x.shape[1], len(SHAPES))
        optimizer = torch.optim.Adam(probe.parameters(), lr=1e-3, weight_decay=1e-4)
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(probe((x - mean) / std), labels["train"]).backward()
            optimizer.step()
        with torch.no_grad():
            predicted = probe((test[part] - mean) / std).argmax(1)
        out[part] = {"held_out_right": int((predicted == labels["held_out"]).sum()), "held_out": len(held_out)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=Path("train/checkpoints/shapes-dev"))
    p.add_argument("-n", type=int, default=100, help="held-out captions (the first n of train.evaluate's draw)")
    p.add_argument("--seed", type=int, default=0, help="train.evaluate's draw of held-out captions")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=3.0, help="text guidance (the checkpoint's default: 3)")
    p.add_argument("--probe-train", type=int, default=0,
                   help="also fit linear shape probes on this many training captions (0: no probes)")
    p.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = p.parse_args(argv)
    held_out = held_out_examples(args.n, args.seed)
    drawer = Drawer(args.checkpoint, args.steps, args.guidance)
    rows = swap_rows(drawer, held_out)
    result = summary(rows)
    if args.probe_train:
        result["shape_probes"] = shape_probes(drawer, examples(training_scenes(0), args.probe_train, 1), held_out)
    print(json.dumps(result, indent=1))
    if args.json:
        command = " ".join(["python -m train.condition_swap", *(sys.argv[1:] if argv is None else argv)])
        args.json.write_text(json.dumps({"command": command, "summary": result, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
