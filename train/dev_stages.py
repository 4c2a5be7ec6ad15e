"""The Dev shapes model's stages: MammothTok (supervised codes), then the AR (captions and edit instructions), then the
DiT (flow matching with the Q-Former and reference latents), and the in-process check of edits.

Everything that turns a picture or a prompt into what the model sees goes through the services' own functions:
MammothTok's resize and normalisation (``ar_service.edit_image``), the edit prompt and its spliced image block
(``prompt_ids_for_edit``, ``tokenize_edit_image``, ``expand_placeholders``), the Dev condition split
(``ar_service.conditions``: ``question_end``, ``text_condition_mask``, ``prompt_tail_rows``), the reference
preprocessing and VAE posterior (``dit_service.references.preprocess_image``, ``DiTPipeline.encode_references``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ar_service.conditions import (
    PROMPT_TAIL,
    image_condition_positions,
    prompt_ids_for,
    prompt_tail_rows,
    question_end,
    text_condition_mask,
)
from ar_service.edit_image import ImagePromptIds, expand_placeholders, pixels_from_image, resize_for_mammothtok, tokenize_edit_image
from ar_service.generation import generate_grid
from ar_service.model.tokenizer import IMAGE_END_TOKEN, build_tokenizer
from ar_service.planning import prompt_ids_for_edit
from ar_service.sampling import SamplingParams
from dit_service.model.transformer import MIN_ROWS, rope_tables
from dit_service.references import preprocess_image
from train import architecture
from train.detect import detect
from train.edits import EDIT_KINDS, EditExample, edit_examples, edit_scores, held_out_edit_examples, split_edits
from train.shapes import Example, Scene, examples, render, shape_mask, split_scenes
from train.stages import (
    EMA,
    StageLog,
    TokenBatch,
    encode_latents,
    fit_ar,
    grid,
    image_tensor,
    noised,
    pack_tokens,
    run_loop,
    scene_grid_ids,
    shape_loss_weights,
    training_scenes,
)
from train.visual_tokens import coverage_codes


@dataclass(frozen=True)
class DevScale:
    """Data and steps of each stage; ``full`` is the GPU run, ``micro`` the CPU test of the code path."""

    tok_scenes: int | None  # None: every scene
    tok_steps: int
    tok_batch: int
    ar_captions: int
    ar_edits: int
    ar_steps: int
    ar_batch: int
    dit_captions: int
    dit_edits: int
    dit_steps: int
    dit_batch: int
    eval_captions: int
    eval_edits: int  # per kind
    eval_steps: int | None = None  # None: the served default


SCALES = {
    "full": DevScale(tok_scenes=None, tok_steps=3000, tok_batch=128, ar_captions=24576, ar_edits=24576, ar_steps=6000,
                     ar_batch=128, dit_captions=8192, dit_edits=8192, dit_steps=40000, dit_batch=256,
                     eval_captions=48, eval_edits=12),
    "micro": DevScale(tok_scenes=3, tok_steps=2, tok_batch=2, ar_captions=3, ar_edits=4, ar_steps=2, ar_batch=3,
                      dit_captions=2, dit_edits=4, dit_steps=2, dit_batch=2, eval_captions=1, eval_edits=1,
                      eval_steps=2),
}


# -- MammothTok ---------------------------------------------------------------------------------------------------------

def picture(scene: Scene) -> Image.Image:
    return Image.fromarray(render(scene))


def mammothtok_pixels(scene: Scene, patch: int) -> torch.Tensor:
    """[1, 3, H, W] in [-1, 1]: the scene's picture as ``tokenize_edit_image`` hands it to MammothTok."""
    return pixels_from_image(resize_for_mammothtok(picture(scene), factor=patch))


def patch_codes(scene: Scene, patch: int) -> np.ndarray:
    """int64 [rows, cols]: what each MammothTok patch shows, coded as the AR's grid cells are (``coverage_codes``):
    the shape's mask goes through the same resize as the picture, then each patch's coverage is its mean."""
    mask = Image.fromarray((shape_mask(scene) * 255).astype(np.uint8))
    resized = np.asarray(resize_for_mammothtok(mask, factor=patch))[..., 0].astype(np.float64) / 255
    rows, cols = resized.shape[0] // patch, resized.shape[1] // patch
    coverage = resized[: rows * patch, : cols * patch].reshape(rows, patch, cols, patch).mean(axis=(1, 3))
    return coverage_codes(scene, coverage)


def code_logits(tok, pixels: torch.Tensor, scale: float = 16.0) -> torch.Tensor:
    """[B, h, w, codes]: scaled cosine similarity of each patch's feature to each codebook row (the nearest code is the
    quantiser's answer)."""
    z = F.normalize(tok.features(pixels).permute(0, 2, 3, 1).float(), dim=-1)
    return scale * z @ F.normalize(tok.quantize.embedding.weight.float(), dim=-1).T


def train_mammothtok(tok, scale: DevScale, seed: int, device, budget_s: float) -> StageLog:
    scenes = training_scenes(seed)[: scale.tok_scenes]
    patch = tok.config.patch_size
    pixels = torch.cat([mammothtok_pixels(s, patch) for s in scenes]).to(device)
    targets = torch.from_numpy(np.stack([patch_codes(s, patch) for s in scenes])).to(device)
    log = StageLog("mammothtok", data={"images": len(scenes), "batch": scale.tok_batch,
                                       "grid": list(targets.shape[1:])})
    generator = torch.Generator(device=device).manual_seed(seed)
    params = [p for p in tok.parameters() if p.requires_grad]
    tok.train()

    def step_fn(step: int) -> torch.Tensor:
        idx = torch.randint(0, pixels.shape[0], (scale.tok_batch,), device=device, generator=generator)
        logits = code_logits(tok, pixels[idx])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[idx].reshape(-1))

    run_loop(log, params, step_fn, scale.tok_steps, budget_s, lr=2e-3, warmup=50)
    tok.eval()
    codes = torch.cat([tok.encode(pixels[i : i + 256]) for i in range(0, pixels.shape[0], 256)])
    log.data["code_accuracy"] = round(float((codes == targets).float().mean()), 4)
    _, held = split_scenes()
    held = held[:: max(1, len(held) // 64)]
    held_codes = tok.encode(torch.cat([mammothtok_pixels(s, patch) for s in held]).to(device)).cpu()
    held_targets = torch.from_numpy(np.stack([patch_codes(s, patch) for s in held]))
    log.data["held_out_code_accuracy"] = round(float((held_codes == held_targets).float().mean()), 4)
    return log


# -- prompts ------------------------------------------------------------------------------------------------------------

class Prompts:
    """The AR's prompt ids for captions and edits, built as ar_service builds them; an edit's input picture goes through
    the trained MammothTok once per source scene."""

    def __init__(self, tok) -> None:
        self.tokenizer = build_tokenizer()
        self.tok = tok
        self.image_ids = ImagePromptIds.from_tokenizer(self.tokenizer, architecture.t2i())
        self.image_end = int(self.tokenizer.convert_tokens_to_ids(IMAGE_END_TOKEN))
        self._blocks: dict[Scene, list[int]] = {}
        self._texts: dict[tuple[str, bool], list[int]] = {}  # the grammar repeats its wordings: tokenise each once

    def caption(self, text: str) -> list[int]:
        if (text, False) not in self._texts:
            self._texts[text, False] = prompt_ids_for(self.tokenizer, text, grid())
        return list(self._texts[text, False])

    def edit(self, instruction: str, source: Scene) -> list[int]:
        """``prompt_ids_for_edit`` with the source picture's MammothTok block spliced in (``expand_placeholders``)."""
        if source not in self._blocks:
            self._blocks[source] = tokenize_edit_image(picture(source), self.tok, self.image_ids).ids
        if (instruction, True) not in self._texts:
            self._texts[instruction, True] = prompt_ids_for_edit(self.tokenizer, instruction, grid(), 1)
        return expand_placeholders(self._texts[instruction, True], self.image_ids.placeholder, [self._blocks[source]])

    def decode_kwargs(self) -> dict:
        """How ar_service decodes a Dev grid: the released split, ``<|image end|>`` fed after the grid."""
        return {"condition_scope": PROMPT_TAIL, "image_end_id": self.image_end}


@dataclass
class Pool:
    """Examples of one stage: prompts, target grids and scenes, and (edits) source scenes."""

    prompts: list[list[int]]
    grids: list[list[int]]
    targets: list[Scene]
    sources: list[Scene | None]
    kinds: list[str]

    @classmethod
    def build(cls, prompts: Prompts, captions: list[Example], edits: list[EditExample]) -> Pool:
        grids: dict[Scene, list[int]] = {}

        def grid_of(scene: Scene) -> list[int]:
            if scene not in grids:
                grids[scene] = scene_grid_ids(scene)
            return grids[scene]

        pool = cls([], [], [], [], [])
        for ex in captions:
            pool.add(prompts.caption(ex.caption), grid_of(ex.scene), ex.scene, None, "caption")
        for ed in edits:
            pool.add(prompts.edit(ed.instruction, ed.edit.source), grid_of(ed.edit.target), ed.edit.target,
                     ed.edit.source, ed.edit.kind)
        return pool

    def add(self, prompt, grid_ids, target, source, kind) -> None:
        self.prompts.append(prompt)
        self.grids.append(grid_ids)
        self.targets.append(target)
        self.sources.append(source)
        self.kinds.append(kind)

    def tokens(self, pad: int, device, tail: list[int] | None = None) -> TokenBatch:
        return pack_tokens(self.prompts, self.grids, pad, device, tail or [])


def training_edits(seed: int, count: int, salt: int) -> list[EditExample]:
    train_set, _ = split_edits(seed=0)  # the held-out scenes are fixed, whatever the training seed
    return edit_examples(train_set, count, seed + salt)


# -- AR -----------------------------------------------------------------------------------------------------------------

def train_ar(ar, prompts: Prompts, scale: DevScale, seed: int, device, budget_s: float) -> StageLog:
    captions = examples(training_scenes(seed), scale.ar_captions, seed + 1)
    pool = Pool.build(prompts, captions, training_edits(seed, scale.ar_edits, 11))
    data = pool.tokens(prompts.tokenizer.pad_token_id, device)
    log = StageLog("ar", data={"captions": len(captions), "edits": scale.ar_edits, "batch": scale.ar_batch,
                               "sequence": data.ids.shape[1]})
    fit_ar(ar, data, log, scale.ar_steps, scale.ar_batch, seed, device, budget_s)
    log.data["held_out_grid_exact"] = grid_accuracy(ar, prompts, scale.eval_captions, scale.eval_edits)
    return log


@torch.no_grad()
def grid_accuracy(ar, prompts: Prompts, captions: int, edits_per_kind: int, seed: int = 0) -> dict[str, float]:
    """Held-out grids decoded greedily as ar_service decodes them: the share equal to the target's, for captions and
    per edit kind."""
    ar.eval()
    _, held = split_scenes()
    t2i = architecture.t2i()
    g = grid()
    cases = [("caption", prompts.caption(ex.caption), ex.scene) for ex in examples(held, captions, seed + 7)]
    cases += [(ed.edit.kind, prompts.edit(ed.instruction, ed.edit.source), ed.edit.target)
              for ed in held_out_edit_examples(edits_per_kind * len(EDIT_KINDS), seed)]
    right: dict[str, list[int]] = {}
    for i, (kind, prompt, scene) in enumerate(cases):
        result = generate_grid(ar, prompt, g, t2i, SamplingParams(temperature=0.0), seed + i, **prompts.decode_kwargs())
        truth = scene_grid_ids(scene)
        right.setdefault(kind, []).append(int(result.token_ids[: len(truth)] == truth))
    return {kind: round(float(np.mean(v)), 3) for kind, v in right.items()}


# -- conditions ---------------------------------------------------------------------------------------------------------

@torch.no_grad()
def dev_conditions(ar, pool: Pool, prompts: Prompts, device, batch: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(text, image) condition of each example as ar_service streams it for Dev: one teacher-forced forward over
    prompt + grid + ``<|image end|>``, the condition states (``gen_condition_layers``), the question's text rows
    (``text_condition_mask`` up to ``question_end``) and the answer's generation rows (``prompt_tail_rows``, the grid,
    ``<|image end|>``)."""
    config = ar.config
    g = grid()
    data = pool.tokens(prompts.tokenizer.pad_token_id, device, tail=[prompts.image_end])
    out = []
    for start in range(0, data.ids.shape[0], batch):
        ids = data.ids[start : start + batch]
        positions = torch.arange(ids.shape[1], device=device)[None].expand(ids.shape[0], -1)
        _, states = ar.model.language_model(ids, positions, None, config.condition_layers)
        for j in range(ids.shape[0]):
            prompt = pool.prompts[start + j]
            p = len(prompt)
            end = question_end(p, g, PROMPT_TAIL, config.text_condition_with_answer)
            text = states[j, :p][text_condition_mask(prompt, config, end).to(device)]
            rows = prompt_tail_rows(prompt, config) + list(range(p, p + len(pool.grids[start + j]) + 1))
            assert len(rows) == image_condition_positions(prompt, g, PROMPT_TAIL, config)
            out.append((text, states[j, rows]))
    return out


# -- DiT ----------------------------------------------------------------------------------------------------------------

def batched_context(dit, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """``MammothDiT.context`` for a batch: [caption_embedder(text) | Q-Former(image)], [B, L + Q, hidden]."""
    embed = dit.time_caption_embed
    return torch.cat([embed.caption_embedder(text), embed.image_embedder(image)], dim=1)


def reference_tokens_batched(dit, refs: torch.Tensor, timestep: torch.Tensor, caption_length: int):
    """``MammothDiT.reference_tokens`` for B samples of one reference each, in one call per layer: tokens [B, n, D],
    their cos/sin [n, rope/2] and the target's axis-0 position."""
    p, dtype = dit.patch_size, dit.dtype
    b, gh, gw = refs.shape[0], refs.shape[2] // p, refs.shape[3] // p
    if gh * gw < MIN_ROWS:
        raise ValueError(f"a reference of {gh}x{gw} patches is padded by the DiT; train with larger references")
    (positions,), shift = dit.reference_positions(caption_length, [(gh, gw)])
    temb = dit.time_caption_embed.timestep_embedding(F.pad(timestep.to(dtype), (0, max(b, MIN_ROWS) - b)), dtype)
    x = dit.ref_image_patch_embedder(dit._patchify(refs.to(dtype))) + dit.image_index_embedding[0].to(dtype)
    cos, sin = rope_tables(positions.to(refs.device)[None], dit.axes_dim_rope)
    for layer in dit.ref_image_refiner:
        x = layer(x, cos.expand(b, -1, -1), sin.expand(b, -1, -1), None, temb)
    return x, cos[0], sin[0], shift


@contextmanager
def batched_references(dit, refs: torch.Tensor, timestep: torch.Tensor, caption_length: int) -> Iterator[list]:
    """While open, ``dit.forward(..., references=<the yielded list>)`` takes sample i's reference tokens from one
    batched computation (``reference_tokens_batched``) instead of B separate ones; same values."""
    tokens, cos, sin, shift = reference_tokens_batched(dit, refs, timestep, caption_length)
    # One unbind, not B indexings: an index's backward writes a zero tensor the size of the whole batch, so B of them
    # cost B times the batch in memory traffic; the unbind's backward is one stack.
    per_sample = iter(tokens.unbind(0))
    dit.reference_tokens = lambda references, t, length: (next(per_sample), cos, sin, shift)
    try:
        yield [[r] for r in refs]
    finally:
        del dit.reference_tokens


def pad_rows(tensors: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([t.shape[0] for t in tensors], device=device)
    packed = torch.zeros(len(tensors), int(lengths.max()), tensors[0].shape[1], device=device)
    for i, t in enumerate(tensors):
        packed[i, : t.shape[0]] = t
    return packed, lengths


DIT_PEAK_LR = 5e-4


def target_weight(scene: Scene, weights: dict[str, float]) -> float:
    """How often an example is drawn, relative to the others of its kind: the product of the factors named for its
    target's shape and size (1 when none is named)."""
    return weights.get(scene.shape, 1.0) * weights.get(scene.size, 1.0)


def qformer_groups(dit, qformer_lr_scale: float) -> list[dict]:
    """AdamW's parameter groups for the DiT: its Q-Former at ``qformer_lr_scale`` times the rate, the rest at 1."""
    qformer = list(dit.time_caption_embed.image_embedder.parameters())
    ids = {id(p) for p in qformer}
    rest = [p for p in dit.parameters() if id(p) not in ids]
    return [{"params": rest, "lr_scale": 1.0}, {"params": qformer, "lr_scale": qformer_lr_scale}]


def train_dit(pipeline, ar, prompts: Prompts, scale: DevScale, seed: int, device, budget_s: float,
              edit_share: float = 0.5, uncond_prob: float = 0.1, ref_prob: float = 0.1, lr: float = DIT_PEAK_LR,
              target_weights: dict[str, float] | None = None, shape_weight: float = 0.0,
              qformer_lr_scale: float = 1.0) -> StageLog:
    """Flow matching as ``train.stages.train_dit`` (same loss, times and EMA), on captions and edits. Each batch is of
    one kind and one text length (no padding anywhere) and is one guidance branch as a whole, as the pipeline calls
    them: a caption batch is conditional ([text | Q-Former(image)]) or, ``uncond_prob`` of the time, unconditional
    (the empty context); an edit batch is conditional with its references, or ``ref_prob`` of the time the reference
    branch (empty context with references), or ``uncond_prob`` of the time unconditional (no references).
    ``target_weights`` (shape or size name -> factor, multiplied) draws examples whose target has that shape or size
    more (or less) often within their batch kind, so training time goes where held-out pictures still miss.
    ``shape_weight``: each latent's squared error weighted by ``train.stages.shape_loss_weights`` of the target (1 +
    ``shape_weight`` where the shape touches it), as the Preview trainer does; 0 keeps the uniform loss."""
    dit, vae = pipeline.transformer, pipeline.vae
    captions = examples(training_scenes(seed), scale.dit_captions, seed + 2)
    pool = Pool.build(prompts, captions, training_edits(seed, scale.dit_edits, 12))
    scenes = sorted(set(pool.targets), key=str)
    index = {s: i for i, s in enumerate(scenes)}
    cfg = vae.config
    latents = (encode_latents(vae, image_tensor([render(s) for s in scenes], device)) - cfg.shift_factor) * cfg.scaling_factor
    sources = sorted({s for s in pool.sources if s is not None}, key=str)
    source_index = {s: i for i, s in enumerate(sources)}
    posteriors = pipeline.encode_references([preprocess_image(picture(s)) for s in sources])
    ref_mean = torch.stack([m for m, _ in posteriors]).to(device)
    ref_std = torch.stack([s for _, s in posteriors]).to(device)
    conds = dev_conditions(ar, pool, prompts, device)
    text, text_lengths = pad_rows([c[0] for c in conds], device)
    image = torch.stack([c[1] for c in conds]).float()
    del conds
    target_of = torch.tensor([index[s] for s in pool.targets], device=device)
    source_of = torch.tensor([-1 if s is None else source_index[s] for s in pool.sources], device=device)
    is_edit = source_of >= 0
    buckets = {kind: [torch.nonzero((text_lengths == n) & (is_edit == kind)).flatten()
                      for n in torch.unique(text_lengths[is_edit == kind])] for kind in (False, True)}
    bucket_lengths = {k: [int(text_lengths[b[0]]) for b in v] for k, v in buckets.items()}
    example_weight = torch.tensor([target_weight(s, target_weights or {}) for s in pool.targets], device=device)
    bucket_draw = {k: [example_weight[b] for b in v] for k, v in buckets.items()}
    weights = {k: torch.stack([w.sum() for w in v]).cpu() if v else torch.zeros(0) for k, v in bucket_draw.items()}
    log = StageLog("dit", data={"captions": len(captions), "edits": int(is_edit.sum()), "images": len(scenes),
                                "sources": len(sources), "batch": scale.dit_batch, "lr": lr, "edit_share": edit_share,
                                "uncond_prob": uncond_prob, "ref_prob": ref_prob, "target_weights": target_weights or {},
                                "shape_weight": shape_weight, "qformer_lr_scale": qformer_lr_scale,
                                "text_rows_max": int(text_lengths.max()), "image_rows": image.shape[1]})
    generator = torch.Generator(device=device).manual_seed(seed)
    # What a step computes (batch kind, text-length bucket, guidance branch) is drawn on the host, so choosing it
    # never waits for the device to finish the step before.
    control = torch.Generator().manual_seed(seed)
    hw = tuple(latents.shape[2:])
    loss_weights = shape_loss_weights(scenes, hw, shape_weight, device) if shape_weight else None
    dit.train().requires_grad_(True)
    dit.pack_samples = False  # every batch has one condition length: no padding
    ema = EMA(dit, decay=0.999 if scale.dit_steps > 1000 else 0.0)

    def uniform() -> float:
        return float(torch.rand((), generator=control))

    def step_fn(step: int) -> torch.Tensor:
        b = scale.dit_batch
        kind = bool(weights[True].numel()) and (not weights[False].numel() or uniform() < edit_share)
        j = int(torch.multinomial(weights[kind], 1, generator=control))
        bucket = buckets[kind][j]
        if target_weights:
            idx = bucket[torch.multinomial(bucket_draw[kind][j], b, replacement=True, generator=generator)]
        else:  # uniform, drawn as before weights existed, so earlier runs' commands draw the same examples
            idx = bucket[torch.randint(0, len(bucket), (b,), device=device, generator=generator)]
        x1 = latents[target_of[idx]]
        x0, t, xt = noised(x1, hw, generator)
        branch = uniform()
        if branch < uncond_prob or (kind and branch < uncond_prob + ref_prob):
            context = x1.new_zeros(b, 0, dit.hidden_size)
        else:
            context = batched_context(dit, text[idx, : bucket_lengths[kind][j]], image[idx])
        if not kind or branch < uncond_prob:
            pred = dit(xt, t, context)
        else:
            src = source_of[idx]
            z = ref_mean[src] + ref_std[src] * torch.randn(ref_mean[src].shape, device=device, generator=generator)
            refs = (z - cfg.shift_factor) * cfg.scaling_factor  # DiTPipeline.sample_references' scaling
            with batched_references(dit, refs, t, context.shape[1]) as references:
                pred = dit(xt, t, context, references=references)
        error = (pred.float() - (x1 - x0)) ** 2
        if loss_weights is None:
            return error.mean()
        weight = loss_weights[target_of[idx]]
        return (error * weight).mean() / weight.mean()

    run_loop(log, qformer_groups(dit, qformer_lr_scale), step_fn, scale.dit_steps, budget_s, lr=lr, warmup=200,
             ema=ema, report_every=200)
    ema.copy_to_module()
    dit.eval().requires_grad_(False)
    return log


# -- in-process check of edits --------------------------------------------------------------------------------------------

IMAGE_GUIDANCES = (1.0, 1.5, 2.0, 3.0)


@torch.no_grad()
def finish(pipeline, entry) -> np.ndarray:
    """The pixels of one started entry, denoised alone step by step as dit_service's batcher steps it."""
    while not entry.done:
        pipeline.step([entry])
    return pipeline.decode(entry.latents)


def held_out_edits(ar, pipeline, prompts: Prompts, per_kind: int, steps: int, guidance: float,
                   image_guidances=IMAGE_GUIDANCES, budget_s: float = 60.0, seed: int = 0) -> list[dict]:
    """Held-out edits through the trained modules in-process as the services run them (greedy AR grid with the Dev
    split, the source picture as the DiT's reference, three-way guidance), scored by the detector
    (``train.edits.edit_scores``): one line per image guidance, with per-kind ``all``."""
    ar.eval()
    t2i = architecture.t2i()
    g = grid()
    size = g.width * architecture.SERVING.pixels_per_token
    empty = torch.zeros(0, ar.config.hidden_size)
    totals = [{"changed": 0.0, "kept": 0.0, "all": 0.0, "grid_exact": 0.0} for _ in image_guidances]
    by_kind: list[dict[str, list[int]]] = [{} for _ in image_guidances]
    done, start = 0, time.monotonic()
    for i, ed in enumerate(held_out_edit_examples(per_kind * len(EDIT_KINDS), seed)):
        if time.monotonic() - start > budget_s:
            break
        result = generate_grid(ar, prompts.edit(ed.instruction, ed.edit.source), g, t2i, SamplingParams(temperature=0.0),
                               seed + i, **prompts.decode_kwargs())
        truth = scene_grid_ids(ed.edit.target)
        posteriors = pipeline.encode_references([preprocess_image(picture(ed.edit.source))])
        for total, kinds, ig in zip(totals, by_kind, image_guidances, strict=True):
            references = pipeline.sample_references(posteriors, seed + i)
            entry = pipeline.start_entry(result.text_condition, result.image_condition, empty, size, size, seed + i,
                                         steps, guidance, references=references, image_guidance=ig)
            scores = edit_scores(detect(finish(pipeline, entry)), ed.edit)
            for key, ok in scores.items():
                total[key] += int(ok)
            total["grid_exact"] += int(result.token_ids[: len(truth)] == truth)
            kinds.setdefault(ed.edit.kind, []).append(int(scores["all"]))
        done += 1
    return [{"edits": done, "steps": steps, "guidance": guidance, "image_guidance": ig,
             **{k: round(v / max(done, 1), 3) for k, v in total.items()},
             "all_by_kind": {k: round(float(np.mean(v)), 3) for k, v in kinds.items()}}
            for total, kinds, ig in zip(totals, by_kind, image_guidances, strict=True)]


def best_image_guidance(lines: list[dict]) -> float | None:
    """The image guidance whose edits read right most often (the lower one on a tie); None without edits checked."""
    lines = [line for line in lines if line["edits"]]
    if not lines:
        return None
    return min(lines, key=lambda line: (-line["all"], line["image_guidance"]))["image_guidance"]

