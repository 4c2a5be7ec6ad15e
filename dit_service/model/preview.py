"""Cheap previews of an image while it is denoised: a linear map from the VAE's latent channels to RGB.

A VAE decode of every preview would cost about what the final decode costs; a per-position linear map from the C
latent channels to the colour of the 8x8 pixel block they stand for costs a few hundred operations per position and
is what latent previews commonly use. The map is not a table copied for one VAE: it is fitted, once, to the VAE the
pipeline holds, so it is right for any channel count and any weights (the tiny test model's random VAE included).

The fit: a fixed set of synthetic pictures (smooth random colour fields with a few hard-edged patches, made from a
fixed seed) is encoded with the VAE's own encoder (the mean of its latent distribution), the latents are put in the
DiT's space (the inverse of the decode's ``z / scaling_factor + shift_factor``), and least squares finds the weights
and bias that best give each block's mean colour from its latent vector. Same VAE, same map, every time.

What is previewed is the image the step predicts, not the noisy state: with flow matching's straight path
x_t = t * data + (1 - t) * noise and the velocity v = data - noise the transformer predicts, the data estimate after
a step to time t is x_t + (1 - t) * v (sampler.DenoiseEntry.predicted_data).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

FIT_SEED = 0
FIT_IMAGES = 8
FIT_LATENT_SIDE = 16  # latent positions per side of each fitting picture (128 pixels with an 8x VAE)


def synthetic_pictures(count: int, side: int, seed: int = FIT_SEED) -> torch.Tensor:
    """[count, 3, side, side] pictures in [-1, 1]: smooth random colour fields, each with a few flat rectangles."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, 4, 4, generator=generator) * 2 - 1
    pictures = F.interpolate(coarse, size=(side, side), mode="bicubic", align_corners=False).clamp(-1, 1)
    for picture in pictures:
        for _ in range(3):
            x0, y0 = (int(v) for v in torch.randint(0, side // 2, (2,), generator=generator))
            w, h = (int(v) for v in torch.randint(side // 8, side // 2, (2,), generator=generator))
            picture[:, y0 : y0 + h, x0 : x0 + w] = (torch.rand(3, 1, 1, generator=generator) * 2 - 1)
    return pictures


@dataclass
class LatentPreviewer:
    """RGB = weight @ latent + bias per latent position, upsampled by the VAE's scale factor to the image's size."""

    weight: torch.Tensor  # [3, C] float32, on the pipeline's device
    bias: torch.Tensor  # [3] float32
    scale_factor: int

    @classmethod
    @torch.no_grad()
    def fit(cls, vae, device: torch.device | str, dtype: torch.dtype) -> LatentPreviewer:
        """Fits the map to ``vae`` (a diffusers AutoencoderKL) by encoding ``synthetic_pictures``; see the module doc."""
        config = vae.config
        scale_factor = 2 ** (len(config.block_out_channels) - 1)
        pictures = synthetic_pictures(FIT_IMAGES, FIT_LATENT_SIDE * scale_factor)
        encoded = vae.encode(pictures.to(device=device, dtype=dtype)).latent_dist.mean.float()
        if not torch.isfinite(encoded).all():  # else the fit below fails with LAPACK's "illegal value" message
            raise RuntimeError(
                f"the VAE's encoder gave non-finite latents for the preview fit on {device} ({dtype}); the VAE does "
                "not compute correctly on this device as configured (e.g. a CUDA MPS client limited to too few SMs)"
            )
        if getattr(config, "shift_factor", None) is not None:
            encoded = encoded - config.shift_factor
        if config.scaling_factor is not None:
            encoded = encoded * config.scaling_factor
        targets = F.avg_pool2d(pictures, scale_factor)  # [B, 3, s, s]: each latent position's block colour
        channels = encoded.shape[1]
        inputs = encoded.permute(0, 2, 3, 1).reshape(-1, channels).cpu().double()
        inputs = torch.cat([inputs, torch.ones(inputs.shape[0], 1, dtype=torch.float64)], dim=1)
        outputs = targets.permute(0, 2, 3, 1).reshape(-1, 3).double()
        solution = torch.linalg.lstsq(inputs, outputs).solution  # [C + 1, 3]
        weight = solution[:channels].T.float().contiguous().to(device)
        bias = solution[channels].float().to(device)
        return cls(weight, bias, scale_factor)

    @torch.no_grad()
    def rgb(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [1, C, h, w] (DiT space) -> colours [3, h, w] in [-1, 1] at latent resolution."""
        latents = latents.to(device=self.weight.device, dtype=torch.float32)
        return (torch.einsum("oc,chw->ohw", self.weight, latents[0]) + self.bias[:, None, None]).clamp(-1, 1)

    @torch.no_grad()
    def pixels(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [1, C, h, w] -> uint8 pixels [h * f, w * f, 3]: the final image's size (bilinear upsampling)."""
        small = self.rgb(latents)[None]
        full = F.interpolate(small, scale_factor=self.scale_factor, mode="bilinear", align_corners=False)[0]
        pixels = ((full.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(1, 2, 0).cpu().numpy()
