"""The DiT stage as one object: load transformer + VAE + scheduler config from disk, denoise, decode to pixels."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL

from dit_service.model.sampler import DenoiseResult, denoise
from dit_service.model.transformer import ArditDiTTransformer


class DiTPipeline:
    """Holds the loaded modules; stateless between calls (every render builds its own scheduler)."""

    def __init__(self, transformer: ArditDiTTransformer, vae: AutoencoderKL, scheduler_config: dict, device, dtype):
        self.transformer = transformer.eval()
        self.vae = vae.eval()
        self.scheduler_config = scheduler_config
        self.device = torch.device(device)
        self.dtype = dtype

    @classmethod
    def from_directory(cls, root: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        """Loads ``root/dit``, ``root/vae`` and ``root/scheduler/scheduler_config.json``; local files only."""
        root = Path(root)
        for needed in ("dit/config.json", "vae/config.json", "scheduler/scheduler_config.json"):
            if not (root / needed).is_file():  # fail plainly rather than via diffusers' Hub fallback message
                raise FileNotFoundError(f"{root / needed} is missing; is {root} a DiT pipeline directory?")
        # low_cpu_mem_usage=False: plain loading, without needing (or warning about) accelerate.
        load = {"local_files_only": True, "torch_dtype": dtype, "low_cpu_mem_usage": False}
        transformer = ArditDiTTransformer.from_pretrained(root / "dit", **load)
        vae = AutoencoderKL.from_pretrained(root / "vae", **load)
        scheduler_config = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
        return cls(transformer.to(device), vae.to(device), scheduler_config, device, dtype)

    # -- geometry ---------------------------------------------------------------------------------------------

    @property
    def condition_dim(self) -> int:
        return self.transformer.config.cond_dim

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def patch_size(self) -> int:
        return self.transformer.config.patch_size

    @property
    def size_multiple(self) -> int:
        """Pixel sizes must be multiples of this (VAE downsampling times DiT patch: 16)."""
        return self.vae_scale_factor * self.patch_size

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """(channels, height/8, width/8) for a width x height image; rejects sizes off the 16-pixel grid."""
        m = self.size_multiple
        if width <= 0 or height <= 0 or width % m or height % m:
            raise ValueError(f"width and height must be positive multiples of {m}; got {width}x{height}")
        f = self.vae_scale_factor
        return (self.latent_channels, height // f, width // f)

    # -- work -------------------------------------------------------------------------------------------------

    def render_latents(
        self,
        condition: torch.Tensor,
        uncond_condition: torch.Tensor,
        width: int,
        height: int,
        seed: int,
        steps: int,
        guidance: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        on_step: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> DenoiseResult:
        """Denoises one image's latents from condition [L, C] (uncond [Lu, C], Lu may be 0)."""
        for name, tensor in (("condition", condition), ("uncond_condition", uncond_condition)):
            if tensor.ndim != 2 or tensor.shape[1] != self.condition_dim:
                raise ValueError(f"{name} must be [positions, {self.condition_dim}]; got {tuple(tensor.shape)}")
        return denoise(
            self.transformer,
            condition,
            uncond_condition,
            self.latent_shape(width, height),
            seed=seed,
            steps=steps,
            guidance=guidance,
            cfg_range=tuple(cfg_range),
            scheduler_config=self.scheduler_config,
            on_step=on_step,
            should_stop=should_stop,
            device=self.device,
            dtype=self.dtype,
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [1,C,h,w] or [C,h,w] -> uint8 pixels [H,W,3]; undoes the Flux-style scale and shift first."""
        if latents.ndim == 3:
            latents = latents[None]
        if latents.shape[0] != 1:
            raise ValueError(f"decode takes one image; got batch {latents.shape[0]}")
        config = self.vae.config
        scaling = config.scaling_factor
        shift = getattr(config, "shift_factor", None) or 0.0
        z = latents.to(device=self.device, dtype=self.dtype) / scaling + shift
        image = self.vae.decode(z, return_dict=False)[0][0].float().clamp(-1, 1)
        pixels = ((image + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(1, 2, 0).cpu().numpy()
