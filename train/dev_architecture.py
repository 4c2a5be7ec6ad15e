"""The shapes model at the MammothModa2-Dev layout: its sizes, fresh modules (the classes the services load), and the
warm start from the Preview-layout shapes checkpoint (``train/checkpoints/shapes``).

- AR: ``MammothModa2AR`` as the Dev member (``mammothmoda2_qwen3_vl``: explicit head_dim, no attention biases,
  per-head q/k RMSNorm, interleaved MRoPE) at the shapes model's sizes: hidden 128, 4 layers, 4 / 2 heads of 32,
  FFN 352, FFN generation experts on every layer, rope_theta 1e6 (the shapes AR's: text positions make every MRoPE
  layout plain 1-D RoPE, so the warm-started projections see the rotations they were trained with). The DiT's
  condition is the last layer's output before the final norm (``gen_condition_layers`` [-1]).
- MammothTok: the released encoder at toy width (64, 2 blocks, 2 heads), patch 14, a 64 x 8 codebook whose 64 codes
  are the tiny tokenizer's 64 visual tokens (a 128x128 input is resized to 126x126: a 9x9 code grid).
- DiT: the shapes DiT with the Q-Former inside it (``is_image_embedder``; 64 queries, 2 layers) and its reference
  path (``ref_image_patch_embedder``, ``ref_image_refiner``, ``image_index_embedding``); the same AutoencoderKL.
Served like the shapes model (128x128, 16 pixels per token: an 8x8 grid, 50 steps, text guidance 3, no default
negative prompt, no AR guidance), with the Dev member's condition split (``prompt_tail``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ar_service.model.configuration import ARConfig, ar_config_from_dict
from ar_service.model.loading import LLM_PREFIX, build_random_ar
from ar_service.model.mammothtok import CHECKPOINT_PREFIX, MammothTok, init_random_
from ar_service.model.modeling import MammothModa2AR
from ar_service.model.tiny import tiny_dev_llm_config
from dit_service.model.pipeline import DEV_CONDITION_MODE, DIT_PREFIX, VAE_PREFIX, DiTPipeline, build_modules
from dit_service.model.weights import load_strict, materialize, random_init_
from servicekit.checkpoint import open_checkpoint
from tools.make_tiny import write_atomically, write_pipeline
from train import architecture
from train import checkpoint as preview_checkpoint

HIDDEN = architecture.HIDDEN
CONDITION_LAYERS = (-1,)
#: MammothTok's sizes (root config ``gen_tokenizer_config``); codebook_size = the tiny tokenizer's visual tokens.
TOKENIZER_CONFIG = {"embed_dim": 64, "num_blocks": 2, "num_heads": 2, "mlp_hidden_dim": 128,
                    "codebook_embed_dim": 8, "codebook_size": 64}
IMAGE_EMBEDDER_CONFIG = {"num_queries": 64, "num_layers": 2}
#: Image guidance (edits) written as the default until the in-process check picks one (``with_image_guidance``).
DEFAULT_IMAGE_GUIDANCE = 1.5
SERVING = replace(
    architecture.SERVING, condition_scope="prompt_tail",
    knob_defaults={**architecture.SERVING.knob_defaults, "image_guidance_scale": DEFAULT_IMAGE_GUIDANCE},
)
#: What the warm start leaves fresh in the DiT: the Q-Former and the reference path (untrained in the Preview model).
FRESH_DIT_PREFIXES = ("time_caption_embed.image_embedder.", "ref_image_patch_embedder.", "ref_image_refiner.",
                      "image_index_embedding")


def with_image_guidance(scale: float):
    """``SERVING`` with ``scale`` as the image guidance default."""
    return replace(SERVING, knob_defaults={**SERVING.knob_defaults, "image_guidance_scale": float(scale)})


def llm_config() -> dict:
    config = copy.deepcopy(tiny_dev_llm_config())
    config["text_config"].update(
        hidden_size=HIDDEN, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rope_theta=1000000.0,
        rope_scaling={"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True},  # 16 = 32 / 2
        moe_type="ffn",
    )
    config["moe_type"] = "ffn"
    config["vision_config"]["out_hidden_size"] = HIDDEN
    return config


def gen_parts(vae_scaling: float = 1.0, vae_shift: float = 0.0) -> dict:
    parts = copy.deepcopy(architecture.gen_parts(vae_scaling, vae_shift))
    parts["gen_dit_config"]["is_image_embedder"] = True
    parts["gen_image_condition_refiner_config"] = dict(IMAGE_EMBEDDER_CONFIG)
    parts["gen_condition_mode"] = DEV_CONDITION_MODE
    parts["gen_condition_layers"] = list(CONDITION_LAYERS)
    parts["gen_tokenizer_config"] = dict(TOKENIZER_CONFIG)
    return parts


def root_config(parts: dict | None = None) -> dict:
    return {"model_type": "mammothmoda2", "llm_config": llm_config(), **(parts or gen_parts())}


def ar_config() -> ARConfig:
    return ar_config_from_dict(root_config())


def new_ar(device, seed: int) -> MammothModa2AR:
    return build_random_ar(ar_config(), device, torch.float32, seed=seed).train()


def spread_codebook(size: int, dim: int, seed: int, steps: int = 500) -> torch.Tensor:
    """``size`` unit rows in ``dim`` dimensions pushed apart (a soft max-min-angle packing; deterministic)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        return _spread(F.normalize(torch.randn(size, dim, generator=generator), dim=-1), steps)


def _spread(start: torch.Tensor, steps: int) -> torch.Tensor:
    size = start.shape[0]
    rows = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([rows], lr=0.01)
    for _ in range(steps):
        unit = F.normalize(rows, dim=-1)
        cos = unit @ unit.T - 2 * torch.eye(size)
        loss = torch.logsumexp(cos.flatten() * 20, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return F.normalize(rows.detach(), dim=-1)


def new_mammothtok(device, seed: int) -> MammothTok:
    """Random encoder, fixed well-spread codebook (not trained: the encoder learns to point at its rows)."""
    model = init_random_(MammothTok.from_config(TOKENIZER_CONFIG), seed=seed)
    codebook = spread_codebook(TOKENIZER_CONFIG["codebook_size"], TOKENIZER_CONFIG["codebook_embed_dim"], seed)
    with torch.no_grad():
        model.quantize.embedding.weight.copy_(codebook)
    model.quantize.embedding.weight.requires_grad_(False)
    return model.to(device).train()


def new_dit_and_vae(device, seed: int):
    """(DiT, VAE) with fresh weights; the DiT's output projection starts at zero and the new paths near neutral
    (``neutral_new_paths_``)."""
    dit, vae, _ = build_modules(root_config())
    random_init_(materialize(dit, device, torch.float32), seed=seed)
    with torch.no_grad():
        dit.norm_out.linear_2.weight.zero_()
        dit.norm_out.linear_2.bias.zero_()
    neutral_new_paths_(dit)
    torch.manual_seed(seed + 1)
    vae = type(vae).from_config(vae.config).to(device)
    return dit.train(), vae.train()


@torch.no_grad()
def neutral_new_paths_(dit) -> None:
    """The Q-Former's residual branches (attention outputs, FFN down projections) start at zero, so its tokens are
    its small learnt queries; the reference refiner's tanh gates start closed (their modulation linears zeroed), so a
    reference token starts as its patch embedding, and the index embedding at zero."""
    embedder = dit.time_caption_embed.image_embedder
    embedder.query.normal_(0, 0.02)
    for layer in embedder.layers:
        for proj in (layer.self_attn.out_proj, layer.cross_attn.out_proj, layer.ffn.linear_2):
            proj.weight.zero_()
            if proj.bias is not None:
                proj.bias.zero_()
    for layer in dit.ref_image_refiner:
        layer.norm1.linear.weight.zero_()
        layer.norm1.linear.bias.zero_()
    dit.image_index_embedding.zero_()


# -- warm start -------------------------------------------------------------------------------------------------------

@dataclass
class WarmStart:
    """What came from the Preview checkpoint: per part, tensors and parameters copied, and the names left fresh."""

    copied: dict[str, int] = field(default_factory=dict)
    parameters: dict[str, int] = field(default_factory=dict)
    fresh: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"tensors_copied": self.copied, "parameters_copied": self.parameters,
                "fresh_tensors": {k: len(v) for k, v in self.fresh.items()},
                "fresh_examples": {k: v[:8] for k, v in self.fresh.items()}}


@torch.no_grad()
def copy_matching(module: torch.nn.Module, source: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> tuple[int, int, list[str]]:
    """Copies every tensor of ``source`` whose name and shape match one of ``module``'s (names under ``skip`` left
    alone); returns (tensors, parameters copied, names left as they were)."""
    tensors = params = 0
    fresh = []
    for name, target in module.state_dict().items():
        value = source.get(name)
        if value is None or tuple(value.shape) != tuple(target.shape) or name.startswith(skip):
            fresh.append(name)
            continue
        target.copy_(value)
        tensors += 1
        params += target.numel()
    return tensors, params, fresh


def warm_start(source: Path, ar, dit, vae, device) -> WarmStart:
    """The Preview shapes checkpoint's weights into the Dev modules: the VAE exactly (with its scaling and shift), every
    DiT tensor of the same name and shape outside ``FRESH_DIT_PREFIXES``, every AR tensor of the same name and shape
    (the Dev AR has no q/k/v biases; its q/k norms keep their 1s)."""
    preview_ar, preview_dit, preview_vae = preview_checkpoint.load(Path(source), device)
    report = WarmStart()
    vae.load_state_dict(preview_vae.state_dict(), strict=True)
    vae.register_to_config(scaling_factor=preview_vae.config.scaling_factor, shift_factor=preview_vae.config.shift_factor)
    report.copied["vae"] = len(vae.state_dict())
    report.parameters["vae"] = sum(p.numel() for p in vae.parameters())
    report.fresh["vae"] = []
    for part, module, src, skip in (("dit", dit, preview_dit, FRESH_DIT_PREFIXES), ("ar", ar, preview_ar, ())):
        tensors, params, fresh = copy_matching(module, src.state_dict(), skip)
        report.copied[part], report.parameters[part], report.fresh[part] = tensors, params, fresh
    with torch.no_grad():
        for name, param in ar.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(1.0)
    return report


# -- checkpoint --------------------------------------------------------------------------------------------------------

def save(target: Path, ar, dit, vae, tok: MammothTok, serving=SERVING) -> None:
    """The Dev pipeline directory through the tiny model's save path: AR, MammothTok under ``gen_tokenizer.
    image_tokenizer.``, DiT (Q-Former inside), VAE with its factors, tokenizer, t2i config, serving defaults."""
    tensors = {}
    for prefix, module in ((LLM_PREFIX, ar), (CHECKPOINT_PREFIX, tok), (DIT_PREFIX, dit), (VAE_PREFIX, vae)):
        tensors.update({prefix + k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()})
    parts = gen_parts(vae.config.scaling_factor, vae.config.shift_factor)
    write_atomically(Path(target), lambda root: write_pipeline(root, llm_config(), parts, tensors, serving,
                                                               architecture.t2i()))


def load(source: Path, device, seed: int = 0):
    """(AR, DiT, VAE, MammothTok) in float32 with the weights of a Dev checkpoint written by ``save``."""
    checkpoint = open_checkpoint(source)
    ar = new_ar(device, seed)
    ar.load_state_dict(checkpoint.load_tensors(LLM_PREFIX, device, torch.float32), strict=True)
    dit, vae = new_dit_and_vae(device, seed)
    load_strict(dit, checkpoint.load_tensors(DIT_PREFIX, device, torch.float32), DIT_PREFIX)
    load_strict(vae, checkpoint.load_tensors(VAE_PREFIX, device, torch.float32), VAE_PREFIX)
    vae_config = checkpoint.config["gen_vae_config"]
    vae.register_to_config(scaling_factor=vae_config["scaling_factor"], shift_factor=vae_config["shift_factor"])
    tok = new_mammothtok(device, seed)
    tok.load_state_dict(checkpoint.load_tensors(CHECKPOINT_PREFIX, device, torch.float32), strict=True)
    return ar, dit, vae, tok


def pipeline_for(dit, vae, device) -> DiTPipeline:
    return DiTPipeline(dit, vae, None, DEV_CONDITION_MODE, device, torch.float32)
