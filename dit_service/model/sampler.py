"""Flow-matching Euler sampling with classifier-free guidance and the resolution-dependent time shift.

Facts (no code copied): bytedance/mammothmoda ``mammothmoda2/utils/t2i_utils.py`` (``processing``,
``decode_diffusion_image``) and vllm-project/vllm-omni ``vllm_omni/diffusion/models/mammoth_moda2/schedulers.py``
and ``pipeline_mammothmoda2_dit.py``:
- Time runs from t = 0 (pure noise) to t = 1 (data); the transformer gets t itself and predicts the velocity
  (data - noise) of the linear path x_t = t * x_data + (1 - t) * noise (``create_transport(path_type="Linear",
  prediction="velocity")`` in modeling_mammothmoda2.py).
- The inference schedule is built in code, not read from a file: ``FlowMatchEulerDiscreteScheduler()`` with its
  defaults (1000 train steps, ``dynamic_time_shift=True``). N steps: t_i = i/N for i < N, warped by
  t' = t / (m - m*t + t) with m = sqrt(num_tokens) / 40 and num_tokens = latent_h * latent_w (the VAE latent, i.e.
  (H/8) * (W/8)): m = 3.2 at 1024x1024. The last step ends at t = 1.
- Euler: x <- x + (t_{i+1} - t_i) * v, in float32.
- CFG: pred = uncond + g * (cond - uncond), only when g > 1 and cfg_range[0] <= i/N <= cfg_range[1]; outside the
  range only the conditional branch runs (tests/test_cfg_range.py upstream: N=4, range (0.5, 1) -> 6 calls). That
  per-step rule is vllm-omni's and an unmerged upstream fix's (``cfg_range_policy`` "per_step", the default); the
  released qwen25vl ``t2i_utils.py`` lines 218-219 overwrite the scale in place, so the first step outside the range
  turns guidance off for good ("off_after_first_exit").

Editing (main ``mamoda2/mammothmoda2/utils/t2i_utils.py`` 187-273, 337-346): an entry with reference latents runs
three-way guidance. Branches: cond (its condition and the references), ref (the unconditional condition and the
references, no Q-Former tokens) and uncond (the unconditional condition, no references). With text guidance tg > 1 and
image guidance ig > 1, pred = uncond + ig (ref - uncond) + tg (cond - ref); with only tg > 1, pred = uncond +
tg (cond - uncond), the uncond branch without references; otherwise pred = cond (also when ig > 1 and tg <= 1).
Without references ig is 1. cfg_range switches both scales together (224-225), under the same ``cfg_range_policy``.

``gen_transport_config`` only parameterises the training transport upstream (it is passed to create_transport,
which inference never uses), so nothing here reads it.

ardit's own: the latent state stays float32 between steps (the references cast it back to the model dtype after
every step), the initial noise is drawn on the CPU from the request's seed (same image on any device), and
``cfg_mode="packed"`` evaluates both branches as one padded batch of two (see transformer.py: bit-identical to
``"sequential"`` on CPU in float32).

A fresh schedule is computed for every image: nothing is shared between requests (diffusers issue #7851). The sampler
is step-wise (``start_entry``, ``step_entries``): the engine batches entries at different steps into one transformer
call per step, and ``denoise`` is the same step on a batch of one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

SHIFT_DIVISOR = 40.0
NUM_TRAIN_TIMESTEPS = 1000  # the reference scheduler's default; only its training grid uses it
CFG_MODES = ("sequential", "packed")
CFG_RANGE_POLICIES = ("per_step", "off_after_first_exit")


class DenoiseCancelled(Exception):
    """Raised between steps when the caller asked to stop (client gone, deadline passed)."""

    def __init__(self, message: str = "denoise cancelled", steps_done: int = 0):
        super().__init__(message)
        self.steps_done = steps_done


@dataclass
class DenoiseResult:
    latents: torch.Tensor  # [1, C, h, w], float32
    transformer_calls: int


def resolution_shift(latent_h: int, latent_w: int) -> float:
    """m = sqrt(VAE-latent positions) / 40 (3.2 at 1024x1024, whose latent is 128x128)."""
    return math.sqrt(latent_h * latent_w) / SHIFT_DIVISOR


def timesteps(steps: int, latent_h: int, latent_w: int, dynamic_time_shift: bool = True) -> torch.Tensor:
    """N + 1 float32 times t_0 .. t_N: t_i = shift(i / N), t_N = 1 (t = 0 is noise, t = 1 is data)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    t = np.arange(steps, dtype=np.float64) / steps
    if dynamic_time_shift:
        m = resolution_shift(latent_h, latent_w)
        t = t / (m - m * t + t)
    return torch.from_numpy(np.append(t, 1.0).astype(np.float32))


def uses_cfg(step: int, steps: int, guidance: float, cfg_range: tuple[float, float], policy: str = "per_step") -> bool:
    """True when step i (0-based) of N runs both branches: g > 1 and cfg_range[0] <= i/N <= cfg_range[1] ("per_step");
    under "off_after_first_exit" also every earlier step was inside the range. Steps run in order from i/N = 0, so an
    earlier step was outside exactly when cfg_range[0] > 0 (step 0 is) or i/N > cfg_range[1]."""
    if policy == "off_after_first_exit":
        return guidance > 1.0 and cfg_range[0] <= 0.0 and step / steps <= cfg_range[1]
    if policy != "per_step":
        raise ValueError(f"cfg_range policy must be one of {', '.join(CFG_RANGE_POLICIES)}; got {policy!r}")
    return guidance > 1.0 and cfg_range[0] <= step / steps <= cfg_range[1]


def initial_noise(latent_shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    """Gaussian noise drawn on the CPU so the same seed gives the same image on any device."""
    generator = torch.Generator("cpu").manual_seed(seed % 2**64)
    return torch.randn((1, *latent_shape), generator=generator, dtype=torch.float32)


def pack_conditions(conditions: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """[L_i, C] tensors -> zero-padded [B, max L, C] and the lengths."""
    lengths = [int(c.shape[0]) for c in conditions]
    width = max(lengths)
    batch = conditions[0].new_zeros(len(conditions), width, conditions[0].shape[1])
    for i, c in enumerate(conditions):
        batch[i, : c.shape[0]] = c
    return batch, lengths


@dataclass
class DenoiseEntry:
    """One image being denoised: its own seed-drawn latents, schedule, guidance and position in it.

    The step-wise form of the sampler: ``start_entry`` makes one, ``step_entries`` runs one Euler step for any
    number of entries (each at its own step index and timestep) and ``denoise`` loops it for one image. The engine
    keeps a running batch of entries that join and leave between steps; nothing is shared between entries.
    """

    cond: torch.Tensor  # [L, C] on the device, model dtype
    uncond: torch.Tensor  # [Lu, C]; may have 0 rows
    latents: torch.Tensor  # [1, C, h, w] float32
    t: torch.Tensor  # [N + 1] float32
    steps: int
    guidance: float
    cfg_range: tuple[float, float]
    cfg_range_policy: str = "per_step"
    step: int = 0
    rows: int = 0  # transformer evaluations of this image (2 per step inside cfg_range, else 1)
    velocity: torch.Tensor | None = None  # the last step's (guided) velocity [1, C, h, w]; valid until the next step
    # Step caching (``step_entries``): 0 = off. Otherwise a step whose indicator moved less than this (relative L1,
    # summed since the last computed step) reuses the last computed velocity instead of calling the transformer.
    cache_threshold: float = 0.0
    cache_accum: float = 0.0
    cache_last: torch.Tensor | None = None  # the indicator at the previous step
    cache_cfg: int | None = None  # the last computed step's branch count (``branches``: guided or not, and how)
    computed_steps: int = 0  # steps that called the transformer
    skipped_steps: int = 0  # steps that reused the last computed velocity
    # An edit: the reference latents ([C, h_j, w_j] each) the cond and ref branches take, and the image guidance
    # scale (1 without references: t2i_utils.py 342-344).
    references: list[torch.Tensor] | None = None
    image_guidance: float = 1.0

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        _, channels, height, width = self.latents.shape
        return channels, height, width

    def wants_cfg(self) -> bool:
        return uses_cfg(self.step, self.steps, self.guidance, self.cfg_range, self.cfg_range_policy)

    def branches(self) -> int:
        """Transformer rows this step: 3 (cond, ref, uncond: text and image guidance), 2 (cond, uncond) or 1 (cond).
        cfg_range gates both scales at once (t2i_utils.py 224-225): the image scale applies only where the text one
        does, as the released branch test ``tg > 1 and ig > 1`` reads."""
        if not self.wants_cfg():
            return 1
        return 3 if self.references is not None and self.image_guidance > 1.0 else 2

    def predicted_data(self) -> torch.Tensor:
        """The clean latents the last step points at: x_t + (1 - t) * v on the straight path (t = data's time 1).

        What a preview shows: the noisy state itself is mostly noise until late in the schedule."""
        if self.velocity is None:
            raise ValueError("no step has run yet")
        return self.latents + (1.0 - self.t[self.step]) * self.velocity

    def release(self) -> None:
        """Drops the tensors (a cancelled entry frees its memory at once, even if something still holds it)."""
        empty = torch.empty(0)
        self.cond = self.uncond = self.latents = self.t = empty
        self.velocity = self.cache_last = None
        self.references = None


def start_entry(
    condition: torch.Tensor,
    uncond_condition: torch.Tensor,
    latent_shape: tuple[int, int, int],
    seed: int,
    steps: int,
    guidance: float,
    cfg_range: tuple[float, float] = (0.0, 1.0),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    dynamic_time_shift: bool = True,
    cfg_range_policy: str = "per_step",
    cache_threshold: float = 0.0,
    references: list[torch.Tensor] | None = None,
    image_guidance: float = 1.0,
) -> DenoiseEntry:
    """Seeded initial noise and this image's own schedule. ``references``: an edit's reference latents (kept on
    ``device`` in ``dtype``); ``image_guidance`` is 1 without them."""
    if not 0.0 <= cache_threshold <= MAX_CACHE_THRESHOLD:
        raise ValueError(f"cache_threshold must be between 0 and {MAX_CACHE_THRESHOLD}; got {cache_threshold}")
    if cfg_range_policy not in CFG_RANGE_POLICIES:
        raise ValueError(f"cfg_range_policy must be one of {', '.join(CFG_RANGE_POLICIES)}; got {cfg_range_policy!r}")
    _, latent_h, latent_w = latent_shape
    return DenoiseEntry(
        cond=condition.to(device=device, dtype=dtype),
        uncond=uncond_condition.to(device=device, dtype=dtype),
        latents=initial_noise(latent_shape, seed).to(device),
        t=timesteps(steps, latent_h, latent_w, dynamic_time_shift).to(device),
        steps=steps,
        guidance=float(guidance),
        cfg_range=(float(cfg_range[0]), float(cfg_range[1])),
        cfg_range_policy=cfg_range_policy,
        cache_threshold=float(cache_threshold),
        references=None if references is None else [r.to(device=device, dtype=dtype) for r in references],
        image_guidance=float(image_guidance) if references is not None else 1.0,
    )


#: The largest step-caching threshold accepted (the ``dit_cache_threshold`` knob's maximum).
MAX_CACHE_THRESHOLD = 1.0


def _reuses_velocity(entry: DenoiseEntry, indicator: Callable[..., torch.Tensor] | None, dtype: torch.dtype) -> bool:
    """Whether ``entry``'s step may reuse its last computed velocity (step caching, TeaCache-style).

    The indicator (the first block's timestep-modulated input, ``MammothDiT.cache_indicator``) is computed for the
    entry alone, so the decision is a function of the image itself, never of its batch-mates; it covers both CFG
    branches at once (they share latents and time). The relative L1 change of the indicator since the previous step
    is summed since the last computed step; under the threshold the step is skipped. The first and the last step
    are always computed, and so is a step whose guidance differs from the last computed one's (cfg_range)."""
    if entry.cache_threshold <= 0 or indicator is None:
        return False
    current = indicator(entry.latents.to(dtype), entry.t[entry.step : entry.step + 1])
    previous, entry.cache_last = entry.cache_last, current
    if previous is None or entry.velocity is None or entry.step >= entry.steps - 1 or entry.cache_cfg != entry.branches():
        entry.cache_accum = 0.0
        return False
    entry.cache_accum += float((current - previous).abs().mean() / previous.abs().mean().clamp_min(1e-12))
    if entry.cache_accum < entry.cache_threshold:
        return True
    entry.cache_accum = 0.0
    return False


@torch.no_grad()
def step_entries(
    transformer: Callable[..., torch.Tensor],
    entries: list[DenoiseEntry],
    dtype: torch.dtype = torch.float32,
    separate: bool = False,
    indicator: Callable[..., torch.Tensor] | None = None,
) -> int:
    """One Euler step for every entry (all of one latent shape); returns the transformer invocations made.

    Rows: each entry's conditional branch, plus its unconditional branch when guidance applies at its step. By
    default every row goes into one transformer call (packed CFG, and packed across entries: each row carries its
    own timestep and condition length); ``separate=True`` makes one call per row (``cfg_mode="sequential"``).
    On CPU both give the same bits: the transformer keeps every row's arithmetic independent of its batch-mates.

    ``indicator``: ``MammothDiT.cache_indicator``, for entries with a ``cache_threshold``: such an entry's step may
    reuse its last computed velocity (``_reuses_velocity``) and add no row to the call.
    """
    if not entries:
        return 0
    for entry in entries:
        if entry.done:
            raise ValueError("step_entries got an entry that has finished its steps")
    reused = [entry for entry in entries if _reuses_velocity(entry, indicator, dtype)]
    for entry in reused:
        assert entry.velocity is not None  # _reuses_velocity checked it
        i = entry.step
        entry.latents = entry.latents + (entry.t[i + 1] - entry.t[i]) * entry.velocity
        entry.skipped_steps += 1
        entry.step += 1
    entries = [entry for entry in entries if not any(entry is r for r in reused)]
    if not entries:
        return 0
    latents, times, conds, refs = [], [], [], []
    for entry in entries:
        model_in = entry.latents.to(dtype)
        rows = branch_rows(entry)
        for branch, references in rows:
            latents.append(model_in)
            times.append(entry.t[entry.step : entry.step + 1])
            conds.append(branch)
            refs.append(references)
    # Reference latents go to the transformer only when a row has some: text-to-image calls keep their signature.
    extra = (lambda rows: {"references": rows}) if any(r is not None for r in refs) else (lambda rows: {})  # noqa: E731
    if separate:
        preds = [transformer(x, t, c[None], [c.shape[0]], **extra([r])).float()
                 for x, t, c, r in zip(latents, times, conds, refs, strict=True)]
        out = torch.cat(preds)
        calls = len(preds)
    else:
        packed, lengths = pack_conditions(conds)
        out = transformer(torch.cat(latents), torch.cat(times), packed, lengths, **extra(refs)).float()
        calls = 1
    row = 0
    for entry in entries:
        branches = entry.branches()
        pred = guided_velocity(entry, out[row : row + branches])
        row += branches
        entry.rows += branches
        i = entry.step
        entry.cache_cfg = branches
        entry.latents = entry.latents + (entry.t[i + 1] - entry.t[i]) * pred
        entry.velocity = pred
        entry.computed_steps += 1
        entry.step += 1
    return calls


def branch_rows(entry: DenoiseEntry) -> list[tuple[torch.Tensor, list[torch.Tensor] | None]]:
    """The transformer rows of ``entry``'s step, (condition, reference latents or None), in the order
    ``guided_velocity`` reads them: cond, then ref and uncond (three-way) or uncond (two-way)."""
    branches = entry.branches()
    if branches == 3:
        return [(entry.cond, entry.references), (entry.uncond, entry.references), (entry.uncond, None)]
    if branches == 2:
        return [(entry.cond, entry.references), (entry.uncond, None)]
    return [(entry.cond, entry.references)]


def guided_velocity(entry: DenoiseEntry, preds: torch.Tensor) -> torch.Tensor:
    """The step's velocity [1, C, h, w] from ``entry``'s branch predictions ``preds`` [branches, C, h, w]
    (t2i_utils.py 246-262)."""
    branches = entry.branches()
    if branches == 3:
        cond, ref, uncond = preds[0:1], preds[1:2], preds[2:3]
        return uncond + entry.image_guidance * (ref - uncond) + entry.guidance * (cond - ref)
    if branches == 2:
        cond, uncond = preds[0:1], preds[1:2]
        return uncond + entry.guidance * (cond - uncond)
    return preds[0:1]


def denoise(
    transformer: Callable[..., torch.Tensor],
    condition: torch.Tensor,
    uncond_condition: torch.Tensor,
    latent_shape: tuple[int, int, int],
    seed: int,
    steps: int,
    guidance: float,
    cfg_range: tuple[float, float] = (0.0, 1.0),
    cfg_mode: str = "sequential",
    on_step: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    dynamic_time_shift: bool = True,
    cfg_range_policy: str = "per_step",
) -> DenoiseResult:
    """N Euler steps from seeded noise; condition [L, C] and uncond_condition [Lu, C] (either may have 0 rows)."""
    if cfg_mode not in CFG_MODES:
        raise ValueError(f"cfg_mode must be one of {', '.join(CFG_MODES)}; got {cfg_mode!r}")
    entry = start_entry(
        condition, uncond_condition, latent_shape, seed, steps, guidance, cfg_range, device, dtype, dynamic_time_shift,
        cfg_range_policy,
    )
    calls = 0
    while not entry.done:
        if should_stop is not None and should_stop():
            raise DenoiseCancelled(f"denoise cancelled after {entry.step} of {steps} steps", steps_done=entry.step)
        calls += step_entries(transformer, [entry], dtype, separate=cfg_mode == "sequential")
        if on_step is not None:
            on_step(entry.step, steps)
    return DenoiseResult(latents=entry.latents, transformer_calls=calls)
