"""Held-out captions through the trained modules in-process (the services' own decode loop, condition masks,
sampler and VAE decode), scored by the detector; once as the services hand the condition over and once with
its rows scrambled. The training log records both, so a run shows that the DiT reads the condition rows."""

from __future__ import annotations

import random
import time

import torch

from ar_service.conditions import prompt_ids_for
from ar_service.generation import generate_grid
from ar_service.model.tokenizer import build_tokenizer
from ar_service.sampling import SamplingParams
from protos.knobs import MAMMOTHMODA2_KNOBS
from train import architecture
from train.detect import detect
from train.shapes import IMAGE_SIZE, examples, split_scenes
from train.stages import grid, scene_grid_ids

# What the shapes checkpoint serves a request that sends no knobs (its ardit_serving.json), and the family's
# guidance it would get otherwise.
SERVED_STEPS = architecture.SERVING.knob_defaults["num_inference_steps"]
SERVED_GUIDANCE = architecture.SERVING.knob_defaults["text_guidance_scale"]
FAMILY_GUIDANCE = MAMMOTHMODA2_KNOBS.by_name["text_guidance_scale"].default


def scramble_rows(text: torch.Tensor, image: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows in a seeded random order, split back into the text and image parts' sizes."""
    rows = torch.cat([text, image])
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    rows = rows[order.to(rows.device)]
    return rows[: text.shape[0]], rows[text.shape[0] :]


CheckConfig = tuple[int, float, bool]  # (steps, guidance, scramble)
DEFAULT_CHECKS: tuple[CheckConfig, ...] = (
    (SERVED_STEPS, SERVED_GUIDANCE, False), (SERVED_STEPS, SERVED_GUIDANCE, True),
    (20, SERVED_GUIDANCE, False), (SERVED_STEPS, FAMILY_GUIDANCE, False), (20, 5.0, False),
)


@torch.no_grad()
def held_out_accuracy(ar, pipeline, count: int, checks: tuple[CheckConfig, ...] = DEFAULT_CHECKS,
                      budget_s: float = 60.0, seed: int = 0, decode: dict | None = None) -> list[dict]:
    """One score line per (steps, guidance, scramble); each caption's grid is decoded once and rendered per line.
    ``grid_*``: the AR's greedy grid against the scene's own codes (cells right, whole grid right). ``decode``: more
    arguments of ``generate_grid`` (a Dev model's ``condition_scope`` and ``image_end_id``)."""
    tokenizer = build_tokenizer()
    _, held = split_scenes()
    g = grid()
    t2i = architecture.t2i()
    empty = torch.zeros(0, ar.config.hidden_size)
    keys = ("grid_cells", "grid_exact", "background", "shape", "colour", "position", "all")
    totals = [dict.fromkeys(keys, 0.0) for _ in checks]
    done, start = 0, time.monotonic()
    for i, ex in enumerate(examples(held, count, seed=random.Random(seed).randrange(2**31))):
        if time.monotonic() - start > budget_s:
            break
        result = generate_grid(ar, prompt_ids_for(tokenizer, ex.caption, g), g, t2i, SamplingParams(temperature=0.0),
                               seed + i, **(decode or {}))
        truth = scene_grid_ids(ex.scene)
        cells = sum(a == b for a, b in zip(result.token_ids, truth, strict=False)) / len(truth)
        for total, (steps, guidance, scramble) in zip(totals, checks, strict=True):
            text, image = result.text_condition, result.image_condition
            if scramble:
                text, image = scramble_rows(text, image, seed + i)
            latents = pipeline.render_latents(text, image, empty, IMAGE_SIZE, IMAGE_SIZE, seed + i, steps, guidance).latents
            total["grid_cells"] += cells
            total["grid_exact"] += int(result.token_ids[: len(truth)] == truth)
            for key, ok in detect(pipeline.decode(latents)).scores(ex.scene).items():
                total[key] += int(ok)
        done += 1
    return [{"images": done, "steps": steps, "guidance": guidance, "scrambled": scramble,
             **{k: round(v / max(done, 1), 3) for k, v in total.items()}}
            for total, (steps, guidance, scramble) in zip(totals, checks, strict=True)]
