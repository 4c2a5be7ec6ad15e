"""Flow-matching Euler sampling with classifier-free guidance and a resolution-dependent time shift.

The schedule is OmniGen2's / MammothModa2's: a uniform grid of N sigmas from 1 down to 1/N (then 0), warped by
sigma' = m*sigma / (1 + (m-1)*sigma) with m = sqrt(latent_h * latent_w) / 40, i.e. 3.2 at 1024x1024 where the
VAE latent is 128x128 (source: the OmniGen2-style sampling code, which computes ``num_tokens`` from the 2x
upsampled patch grid = VAE latent pixels and ``m = num_tokens**0.5 / 40``; REFERENCE.md "3.2 at 1024^2").
The warp is applied by diffusers' scheduler itself: with ``use_dynamic_shifting=True`` and
``time_shift_type="exponential"`` it computes exp(mu) / (exp(mu) + (1/sigma - 1)), which equals the warp above
for mu = ln(m). Passing ``sigmas`` explicitly keeps the grid ending at 1/N instead of diffusers' default 1/1000.
A config with ``use_dynamic_shifting=False`` uses its static ``shift`` instead.

A fresh scheduler is built from the config dict for every call: the scheduler is stateful (step index), and
sharing one between concurrent or successive requests corrupts the schedule (diffusers issue #7851).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

SHIFT_DIVISOR = 40.0


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
    """Time-shift factor m = sqrt(VAE-latent positions) / 40 (3.2 at 1024x1024)."""
    return math.sqrt(latent_h * latent_w) / SHIFT_DIVISOR


def uses_cfg(step: int, steps: int, guidance: float, cfg_range: tuple[float, float]) -> bool:
    """True when step i (0-based) of N runs both branches: g > 1 and cfg_range[0] <= i/N <= cfg_range[1]."""
    return guidance > 1.0 and cfg_range[0] <= step / steps <= cfg_range[1]


def make_scheduler(scheduler_config: dict, steps: int, latent_h: int, latent_w: int, device) -> FlowMatchEulerDiscreteScheduler:
    """A new scheduler with its timesteps set for this resolution."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(dict(scheduler_config))
    sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
    mu = math.log(resolution_shift(latent_h, latent_w)) if scheduler.config.use_dynamic_shifting else None
    scheduler.set_timesteps(sigmas=sigmas, mu=mu, device=device)
    scheduler.set_begin_index(0)  # step by position, never by looking timesteps up
    return scheduler


def initial_noise(latent_shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    """Gaussian noise drawn on the CPU so the same seed gives the same image on any device."""
    generator = torch.Generator("cpu").manual_seed(seed % 2**64)
    return torch.randn((1, *latent_shape), generator=generator, dtype=torch.float32)


@torch.no_grad()
def denoise(
    transformer: torch.nn.Module,
    condition: torch.Tensor,
    uncond_condition: torch.Tensor,
    latent_shape: tuple[int, int, int],
    seed: int,
    steps: int,
    guidance: float,
    cfg_range: tuple[float, float],
    scheduler_config: dict,
    on_step: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DenoiseResult:
    """Runs N Euler steps from seeded noise; condition [L, C], uncond_condition [Lu, C] (Lu may be 0)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    _, latent_h, latent_w = latent_shape
    scheduler = make_scheduler(scheduler_config, steps, latent_h, latent_w, device)
    latents = initial_noise(latent_shape, seed).to(device)
    cond = condition.to(device=device, dtype=dtype)[None]
    uncond = uncond_condition.to(device=device, dtype=dtype)[None]
    calls = 0
    for i in range(steps):
        if should_stop is not None and should_stop():
            raise DenoiseCancelled(f"denoise cancelled after {i} of {steps} steps", steps_done=i)
        sigma = scheduler.sigmas[i].reshape(1).to(device=device, dtype=dtype)
        model_in = latents.to(dtype)
        pred = transformer(model_in, sigma, cond).float()
        calls += 1
        if uses_cfg(i, steps, guidance, cfg_range):
            pred_uncond = transformer(model_in, sigma, uncond).float()
            calls += 1
            pred = pred_uncond + guidance * (pred - pred_uncond)
        latents = scheduler.step(pred, scheduler.timesteps[i], latents, return_dict=False)[0]
        if on_step is not None:
            on_step(i + 1, steps)
    return DenoiseResult(latents=latents, transformer_calls=calls)
