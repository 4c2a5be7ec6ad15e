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
  range only the conditional branch runs (tests/test_cfg_range.py upstream: N=4, range (0.5, 1) -> 6 calls).

``gen_transport_config`` only parameterises the training transport upstream (it is passed to create_transport,
which inference never uses), so nothing here reads it.

ardit's own: the latent state stays float32 between steps (the references cast it back to the model dtype after
every step), the initial noise is drawn on the CPU from the request's seed (same image on any device), and
``cfg_mode="packed"`` evaluates both branches as one padded batch of two (see transformer.py: bit-identical to
``"sequential"`` on CPU in float32).

A fresh schedule is computed for every call: nothing is shared between requests (diffusers issue #7851).
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


def uses_cfg(step: int, steps: int, guidance: float, cfg_range: tuple[float, float]) -> bool:
    """True when step i (0-based) of N runs both branches: g > 1 and cfg_range[0] <= i/N <= cfg_range[1]."""
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


@torch.no_grad()
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
) -> DenoiseResult:
    """N Euler steps from seeded noise; condition [L, C] and uncond_condition [Lu, C] (either may have 0 rows)."""
    if cfg_mode not in CFG_MODES:
        raise ValueError(f"cfg_mode must be one of {', '.join(CFG_MODES)}; got {cfg_mode!r}")
    _, latent_h, latent_w = latent_shape
    t = timesteps(steps, latent_h, latent_w, dynamic_time_shift).to(device)
    latents = initial_noise(latent_shape, seed).to(device)
    cond = condition.to(device=device, dtype=dtype)
    uncond = uncond_condition.to(device=device, dtype=dtype)
    packed, packed_lengths = pack_conditions([cond, uncond])
    calls = 0
    for i in range(steps):
        if should_stop is not None and should_stop():
            raise DenoiseCancelled(f"denoise cancelled after {i} of {steps} steps", steps_done=i)
        model_in = latents.to(dtype)
        timestep = t[i : i + 1]
        if uses_cfg(i, steps, guidance, cfg_range):
            if cfg_mode == "packed":
                both = transformer(model_in.expand(2, -1, -1, -1), timestep.expand(2), packed, packed_lengths).float()
                pred, pred_uncond = both[:1], both[1:]
                calls += 1
            else:
                pred = transformer(model_in, timestep, cond[None]).float()
                pred_uncond = transformer(model_in, timestep, uncond[None]).float()
                calls += 2
            pred = pred_uncond + guidance * (pred - pred_uncond)
        else:
            pred = transformer(model_in, timestep, cond[None]).float()
            calls += 1
        latents = latents + (t[i + 1] - t[i]) * pred
        if on_step is not None:
            on_step(i + 1, steps)
    return DenoiseResult(latents=latents, transformer_calls=calls)
