"""The three training stages (VAE, then AR, then DiT) and what they share: data, schedule, time box, log.

Every stage stops at ``max_steps`` or when its ``budget_s`` of wall time is spent, whichever comes first; the
learning rate follows progress = max(step / max_steps, elapsed / budget_s) (linear warm-up, cosine decay), so
a stage cut short by its time box still ends annealed, and its weights are saved either way.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ar_service.conditions import image_condition_mask, prompt_ids_for, text_condition_mask
from ar_service.model.modeling import MammothModa2AR
from ar_service.model.tokenizer import build_tokenizer
from ar_service.prompt import Grid, grid_for_size
from train import architecture
from train.shapes import IMAGE_SIZE, Example, Scene, cell_coverage, examples, render, split_scenes
from train.visual_tokens import grid_token_ids, scene_codes


@dataclass(frozen=True)
class Scale:
    """How much data and how many steps; ``full`` is the GPU run, ``micro`` the CPU test of the code path."""

    ar_examples: int
    dit_examples: int
    vae_steps: int
    ar_steps: int
    dit_steps: int
    vae_batch: int
    ar_batch: int
    dit_batch: int
    vae_scenes: int | None = None  # None: every training scene
    eval_examples: int = 24
    eval_steps: int | None = None  # None: the services' default step count


SCALES = {
    "full": Scale(ar_examples=32768, dit_examples=16384, vae_steps=4000, ar_steps=4000, dit_steps=40000,
                  vae_batch=64, ar_batch=128, dit_batch=256),
    "micro": Scale(ar_examples=8, dit_examples=4, vae_steps=1, ar_steps=2, dit_steps=2,
                   vae_batch=1, ar_batch=4, dit_batch=4, vae_scenes=2, eval_examples=1, eval_steps=2),
}


def grid() -> Grid:
    return grid_for_size(IMAGE_SIZE, IMAGE_SIZE, architecture.SERVING.pixels_per_token)


@dataclass
class StageLog:
    name: str
    steps: int = 0
    seconds: float = 0.0
    stopped_by: str = ""
    data: dict = field(default_factory=dict)
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss over the last report window)

    def to_dict(self) -> dict:
        return {"stage": self.name, "steps": self.steps, "seconds": round(self.seconds, 1), "stopped_by": self.stopped_by,
                "data": self.data, "final_loss": self.losses[-1][1] if self.losses else None,
                "losses": [[s, round(v, 6)] for s, v in self.losses]}


def run_loop(log: StageLog, params, step_fn, max_steps: int, budget_s: float, lr: float, warmup: int = 100,
             report_every: int = 50, ema=None) -> None:
    """AdamW over ``params``; ``step_fn(step)`` returns the loss tensor of one batch. ``params`` may be AdamW's
    parameter groups, each with an ``lr_scale`` (1 if absent) that multiplies the schedule's rate for that group."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    clipped = [p for group in optimizer.param_groups for p in group["params"]]
    start = time.monotonic()
    window: list[float] = []
    step = 0
    log.stopped_by = "max_steps"
    while step < max_steps:
        elapsed = time.monotonic() - start
        if elapsed >= budget_s:
            log.stopped_by = "budget_s"
            break
        progress = max(step / max_steps, elapsed / budget_s)
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for group in optimizer.param_groups:
            group["lr"] = lr * max(scale, 0.02) * group.get("lr_scale", 1.0)
        loss = step_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(clipped, 1.0)
        optimizer.step()
        if ema is not None:
            ema.update()
        step += 1
        if step % 10 == 0 or step == max_steps or step == 1:  # a host sync every 10 steps, not every step
            window.append(float(loss.detach()))
        if step % report_every == 0 or step == max_steps:
            mean = float(np.mean(window))
            log.losses.append((step, mean))
            print(f"[{log.name}] step {step} loss {mean:.5f} lr {optimizer.param_groups[0]['lr']:.2e} "
                  f"{time.monotonic() - start:.0f}s", flush=True)
            window = []
    if window:
        log.losses.append((step, float(np.mean(window))))
    log.steps = step
    log.seconds = time.monotonic() - start
    print(f"[{log.name}] done: {step} steps in {log.seconds:.0f}s (stopped by {log.stopped_by})", flush=True)


class EMA:
    """Exponential moving average of a module's parameters (what the DiT stage saves)."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = list(module.parameters())
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """One multi-tensor lerp over every parameter (a few kernels, not one per tensor)."""
        torch._foreach_lerp_(self.shadow, self.params, 1 - self.decay)

    @torch.no_grad()
    def copy_to_module(self) -> None:
        torch._foreach_copy_(self.params, self.shadow)


# -- data ---------------------------------------------------------------------------------------------------------

def image_tensor(images: list[np.ndarray], device) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, 3, H, W] in [-1, 1] (what the VAE encodes and decodes)."""
    array = torch.from_numpy(np.stack(images)).to(device)
    return array.permute(0, 3, 1, 2).float() / 127.5 - 1


def training_scenes(seed: int):
    scenes, _ = split_scenes(seed=0)  # the held-out triples are fixed, whatever the training seed
    rng = random.Random(seed)
    order = list(scenes)
    rng.shuffle(order)
    return order


# -- VAE ------------------------------------------------------------------------------------------------------------

def train_vae(vae, scale: Scale, seed: int, device, budget_s: float, kl_weight: float = 1e-4) -> StageLog:
    scenes = training_scenes(seed)[: scale.vae_scenes]
    images = image_tensor([render(s) for s in scenes], device)
    log = StageLog("vae", data={"images": len(scenes), "batch": scale.vae_batch, "kl_weight": kl_weight})
    generator = torch.Generator(device=device).manual_seed(seed)
    vae.train()

    def step_fn(step: int) -> torch.Tensor:
        idx = torch.randint(0, images.shape[0], (scale.vae_batch,), device=device, generator=generator)
        x = images[idx]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        return F.l1_loss(recon, x) + F.mse_loss(recon, x) + kl_weight * kl

    run_loop(log, list(vae.parameters()), step_fn, scale.vae_steps, budget_s, lr=1e-3, warmup=50)
    vae.eval()
    # The pipeline decodes z / scaling_factor + shift_factor: set both so the DiT's latents are ~zero-mean, unit-std.
    raw = encode_latents(vae, images)
    shift, std = float(raw.mean()), float(raw.std())
    vae.register_to_config(scaling_factor=1.0 / max(std, 1e-6), shift_factor=shift)
    with torch.no_grad():
        recon = vae.decode(raw[: min(64, raw.shape[0])]).sample.clamp(-1, 1)
        log.data["recon_mae_255"] = round(float((recon - images[: recon.shape[0]]).abs().mean()) * 127.5, 3)
    log.data.update(latent_shift=round(shift, 5), latent_std=round(std, 5))
    return log


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Raw posterior means [N, C, h, w] (before scaling and shift)."""
    return torch.cat([vae.encode(images[i : i + batch]).latent_dist.mean for i in range(0, images.shape[0], batch)])


# -- AR -------------------------------------------------------------------------------------------------------------

@dataclass
class TokenBatch:
    ids: torch.Tensor  # [N, L] prompt + grid, right-padded
    prompt_lengths: torch.Tensor  # [N]
    grid_ids: list[list[int]]


def scene_grid_ids(scene: Scene) -> list[int]:
    """The AR's generated ids for ``scene``: its visual tokens row by row, each row closed by an EOL."""
    t2i = architecture.t2i()
    codes = scene_codes(scene, architecture.SERVING.pixels_per_token)
    return grid_token_ids(codes, t2i.visual_token_start_id, t2i.eol_token_id)


def token_batch(examples_: list[Example], tokenizer, device) -> TokenBatch:
    g = grid()
    codes: dict[Scene, list[int]] = {}
    prompts, grids = [], []
    for ex in examples_:
        if ex.scene not in codes:
            codes[ex.scene] = scene_grid_ids(ex.scene)
        prompts.append(prompt_ids_for(tokenizer, ex.caption, g))
        grids.append(codes[ex.scene])
    return pack_tokens(prompts, grids, tokenizer.pad_token_id, device)


def pack_tokens(prompts: list[list[int]], grids: list[list[int]], pad: int, device, tail: list[int] = ()) -> TokenBatch:
    """Rows prompt + grid (+ ``tail``), right-padded with ``pad``."""
    rows = [p + g + list(tail) for p, g in zip(prompts, grids, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
    return TokenBatch(ids.to(device), torch.tensor([len(p) for p in prompts], device=device), grids)


def ar_hidden(model: MammothModa2AR, ids: torch.Tensor) -> torch.Tensor:
    """The AR's final-normed hidden states [B, L, H] over whole rows (what each fed token's forward gives)."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    final, _ = model.model.language_model(ids, positions, None, None)
    return final


def train_ar(model: MammothModa2AR, scale: Scale, seed: int, device, budget_s: float) -> StageLog:
    data = token_batch(examples(training_scenes(seed), scale.ar_examples, seed + 1), build_tokenizer(), device)
    log = StageLog("ar", data={"examples": data.ids.shape[0], "batch": scale.ar_batch, "sequence": data.ids.shape[1]})
    fit_ar(model, data, log, scale.ar_steps, scale.ar_batch, seed, device, budget_s)
    return log


def fit_ar(model: MammothModa2AR, data: TokenBatch, log: StageLog, steps: int, batch: int, seed: int, device,
           budget_s: float) -> None:
    """Teacher forcing: cross-entropy over the generation vocabulary on every grid token of ``data``'s rows."""
    n_targets = grid().condition_positions  # every visual token and EOL of the grid
    gen_start = model.config.gen_vocab_start_index
    generator = torch.Generator(device=device).manual_seed(seed)
    offsets = torch.arange(n_targets, device=device)
    model.train()

    def step_fn(step: int) -> torch.Tensor:
        idx = torch.randint(0, data.ids.shape[0], (batch,), device=device, generator=generator)
        ids = data.ids[idx]
        final = ar_hidden(model, ids)
        # Position p - 1 predicts token p: the grid's tokens sit at prompt_length .. prompt_length + n - 1.
        at = data.prompt_lengths[idx, None] - 1 + offsets[None]
        hidden = final.gather(1, at[..., None].expand(-1, -1, final.shape[-1]))
        targets = ids.gather(1, at + 1) - gen_start
        logits = model.gen_head(hidden).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    run_loop(log, list(model.parameters()), step_fn, steps, budget_s, lr=1e-3, warmup=100)
    model.eval()


@torch.no_grad()
def conditions(model: MammothModa2AR, pipeline, data: TokenBatch, batch: int = 256) -> list[torch.Tensor]:
    """The DiT's condition [L_i, H] for each row, as the services build it: the AR's hidden states over the
    prompt and the teacher-forced grid (the look-ahead token is never fed), split by the services' own masks
    (``text_condition_mask``, ``image_condition_mask``) and joined by the DiT pipeline's ``assemble_condition``."""
    out = []
    config = model.config
    for start in range(0, data.ids.shape[0], batch):
        ids = data.ids[start : start + batch]
        final = ar_hidden(model, ids)
        for j in range(ids.shape[0]):
            p = int(data.prompt_lengths[start + j])
            grid_ids = data.grid_ids[start + j]
            row = ids[j].tolist()
            text = final[j, :p][text_condition_mask(row[:p], config).to(final.device)]
            generated = grid_ids + [grid_ids[0]]  # a look-ahead token, dropped by the mask as in the service
            image = final[j, p : p + len(grid_ids)][image_condition_mask(generated, config).to(final.device)]
            out.append(pipeline.assemble_condition(text, image))
    return out


# -- DiT ------------------------------------------------------------------------------------------------------------

def shifted_times(u: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """The sampler's resolution shift applied to uniform times (training sees the times inference visits)."""
    from dit_service.model.sampler import resolution_shift

    m = resolution_shift(*latent_hw)
    return u / (m - m * u + u)


def noised(x1: torch.Tensor, latent_hw: tuple[int, int], generator: torch.Generator):
    """(noise x0, times t, x_t = t x1 + (1 - t) x0) for a batch of clean latents ``x1``: the times drawn with the
    sampler's resolution shift 70% of the time, uniformly otherwise. The flow-matching target is ``x1 - x0``."""
    b = x1.shape[0]
    x0 = torch.randn(x1.shape, device=x1.device, generator=generator)
    u = torch.rand(b, device=x1.device, generator=generator)
    t = torch.where(torch.rand(b, device=x1.device, generator=generator) < 0.7, shifted_times(u, latent_hw), u)
    return x0, t, t[:, None, None, None] * x1 + (1 - t[:, None, None, None]) * x0


def shape_loss_weights(scenes: list[Scene], latent_hw: tuple[int, int], shape_weight: float, device) -> torch.Tensor:
    """[N, 1, h, w] per-latent loss weights: 1 + ``shape_weight`` where a latent's pixels touch the shape.

    The background is most of every latent and the easiest part to predict; the silhouette's edges and corners
    (what tells a small square from a circle) are a few latents. Weighting them puts the loss where the outline is."""
    touched = np.stack([cell_coverage(s, IMAGE_SIZE // latent_hw[0]) > 0 for s in scenes])[:, None]
    return (1 + shape_weight * torch.from_numpy(touched).float()).to(device)


DIT_PEAK_LR = 1e-3


def train_dit(pipeline, ar: MammothModa2AR, scale: Scale, seed: int, device, budget_s: float,
              uncond_prob: float = 0.1, lr: float = DIT_PEAK_LR, shape_weight: float = 0.0) -> StageLog:
    """Flow matching (x_t = t x_data + (1 - t) noise, target x_data - noise) on the VAE's scaled latents, each
    latent's squared error weighted by ``shape_loss_weights`` (uniform when ``shape_weight`` is 0)."""
    dit, vae = pipeline.transformer, pipeline.vae
    scenes = training_scenes(seed)
    pool = examples(scenes, scale.dit_examples, seed + 2)
    rank = {s: i for i, s in enumerate(scenes)}
    used = sorted({ex.scene for ex in pool}, key=rank.__getitem__)
    index = {s: i for i, s in enumerate(used)}
    raw = encode_latents(vae, image_tensor([render(s) for s in used], device))
    cfg = vae.config
    latents = (raw - cfg.shift_factor) * cfg.scaling_factor
    scene_of = torch.tensor([index[ex.scene] for ex in pool], device=device)
    conds = conditions(ar, pipeline, token_batch(pool, build_tokenizer(), device))
    lengths = torch.tensor([c.shape[0] for c in conds], device=device)
    packed = torch.zeros(len(conds), int(lengths.max()), conds[0].shape[1], device=device)
    for i, c in enumerate(conds):
        packed[i, : c.shape[0]] = c
    del conds
    log = StageLog("dit", data={"examples": len(pool), "images": len(used), "batch": scale.dit_batch, "lr": lr,
                                "shape_weight": shape_weight,
                                "uncond_prob": uncond_prob, "condition_rows_max": int(lengths.max())})
    generator = torch.Generator(device=device).manual_seed(seed)
    hw = tuple(latents.shape[2:])
    loss_weights = shape_loss_weights(used, hw, shape_weight, device)
    # Batches of one condition length: every row of a call is then valid and attention runs as one batched call
    # per layer instead of one per sample (a step costs milliseconds, not a third of a second).
    buckets = [torch.nonzero(lengths == n).flatten() for n in torch.unique(lengths)]
    weights = torch.tensor([len(b) for b in buckets], dtype=torch.float, device=device)
    dit.train().requires_grad_(True)
    dit.pack_samples = False  # every batch has one condition length: the padded layout has no padding here
    ema = EMA(dit, decay=0.999 if scale.dit_steps > 1000 else 0.0)
    empty = packed.new_zeros(scale.dit_batch, 0, packed.shape[-1])

    def step_fn(step: int) -> torch.Tensor:
        b = scale.dit_batch
        bucket = buckets[int(torch.multinomial(weights, 1, generator=generator))]
        idx = bucket[torch.randint(0, len(bucket), (b,), device=device, generator=generator)]
        x1 = latents[scene_of[idx]]
        x0, t, xt = noised(x1, hw, generator)
        n = int(lengths[idx[0]])
        # A whole batch without condition now and then: what guidance's unconditional branch sends.
        cond = empty if torch.rand((), generator=generator, device=device) < uncond_prob else packed[idx, :n]
        pred = dit(xt, t, cond)
        weight = loss_weights[scene_of[idx]]
        return ((pred.float() - (x1 - x0)) ** 2 * weight).mean() / weight.mean()

    run_loop(log, [p for p in dit.parameters()], step_fn, scale.dit_steps, budget_s, lr=lr, warmup=200, ema=ema,
             report_every=200)
    ema.copy_to_module()
    dit.eval().requires_grad_(False)
    return log
