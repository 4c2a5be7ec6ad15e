"""Strict weight loading and random initialisation for the DiT stage's modules."""

from __future__ import annotations

import torch
from torch import nn


class CheckpointMismatch(ValueError):
    """A checkpoint's tensors do not match the module built from its config."""


def load_strict(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Loads ``tensors`` (names without ``prefix``) into ``module``; any missing, unexpected or misshapen tensor
    raises CheckpointMismatch naming the full checkpoint keys. Parameters are taken over as they are (assign)."""
    expected = module.state_dict(keep_vars=True)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshapen = sorted(
        f"{prefix}{name}: checkpoint {tuple(tensors[name].shape)} vs model {tuple(expected[name].shape)}"
        for name in set(expected) & set(tensors)
        if tuple(tensors[name].shape) != tuple(expected[name].shape)
    )
    problems = []
    if missing:
        problems.append("missing " + ", ".join(prefix + n for n in missing))
    if unexpected:
        problems.append("unexpected " + ", ".join(prefix + n for n in unexpected))
    if misshapen:
        problems.append("wrong shape " + "; ".join(misshapen))
    if problems:
        raise CheckpointMismatch(f"checkpoint tensors under {prefix!r} do not match the config: " + " | ".join(problems))
    module.load_state_dict(tensors, strict=True, assign=True)


@torch.no_grad()
def random_init_(module: nn.Module, seed: int, std_scale: float = 1.0) -> nn.Module:
    """Deterministic random weights in place, on whatever device and dtype the parameters already have.

    Matrices and convolutions ~ N(0, std_scale / sqrt(fan_in)); biases 0; 1-D weights (norms) 1; learnable query
    and index embeddings ~ N(0, 1/sqrt(width)). Unlike the references' zero-initialised adaLN and output layers,
    every layer is non-zero, so seeds and conditions visibly change the output of an untrained model.
    """
    params = dict(module.named_parameters())
    device = next(iter(params.values())).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name in sorted(params):
        p = params[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("bias"):
            p.zero_()
        elif p.ndim == 1:
            p.fill_(1.0)
        elif leaf in ("query", "image_index_embedding"):
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=generator)
        else:
            fan_in = p[0].numel()
            p.normal_(0.0, std_scale / fan_in**0.5, generator=generator)
    return module


def materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """A module built on the meta device -> uninitialised storage of ``dtype`` on ``device`` (no CPU round trip)."""
    # nn.Module.to itself: diffusers' ModelMixin.to warns about dtype casts meant for loaded weights.
    return nn.Module.to(module, dtype=dtype).to_empty(device=device)
