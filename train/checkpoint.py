"""Writes the shapes model through the tiny model's save path, and reads it back for the next stage."""

from __future__ import annotations

from pathlib import Path

import torch

from ar_service.model.loading import LLM_PREFIX
from dit_service.model.pipeline import DIT_PREFIX, VAE_PREFIX, DiTPipeline
from dit_service.model.weights import load_strict
from servicekit.checkpoint import open_checkpoint
from tools.make_tiny import write_atomically, write_pipeline
from train import architecture


def save(target: Path, ar, dit, vae) -> None:
    """The whole pipeline directory (config.json, model.safetensors, tokenizer, t2i config, serving defaults);
    the VAE's scaling and shift factors go into gen_vae_config as the trained encoder set them."""
    tensors = {}
    for prefix, module in ((LLM_PREFIX, ar), (DIT_PREFIX, dit), (VAE_PREFIX, vae)):
        tensors.update({prefix + k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()})
    parts = architecture.gen_parts(vae.config.scaling_factor, vae.config.shift_factor)
    write_atomically(
        Path(target),
        lambda root: write_pipeline(root, architecture.llm_config(), parts, tensors, architecture.SERVING, architecture.t2i()),
    )


def load(source: Path, device, seed: int = 0):
    """(AR, DiT, VAE) in float32 on ``device`` with the weights of ``source``, ready to train further."""
    checkpoint = open_checkpoint(source)
    ar = architecture.new_ar(device, seed)
    ar.load_state_dict(checkpoint.load_tensors(LLM_PREFIX, device, torch.float32), strict=True)
    dit, vae = architecture.new_dit_and_vae(device, seed)
    load_strict(dit, checkpoint.load_tensors(DIT_PREFIX, device, torch.float32), DIT_PREFIX)
    load_strict(vae, checkpoint.load_tensors(VAE_PREFIX, device, torch.float32), VAE_PREFIX)
    vae_config = checkpoint.config["gen_vae_config"]
    vae.register_to_config(scaling_factor=vae_config["scaling_factor"], shift_factor=vae_config["shift_factor"])
    return ar, dit, vae


def pipeline_for(dit, vae, device) -> DiTPipeline:
    """The services' DiT pipeline around the training modules (its condition assembly, sampler and decode)."""
    return DiTPipeline(dit, vae, None, architecture.gen_parts()["gen_condition_mode"], device, torch.float32)
