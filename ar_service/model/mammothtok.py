"""MammothTok's encoder side: an RGB image in [-1, 1] -> a grid of discrete codes (MammothModa2-Dev image editing).

Facts from bytedance/mammothmoda ``main``, folder ``mamoda2/mammothmoda2/model/mammothmoda2_visual_tokenizers/``
(``../shared/reference/mammothmoda2-dev.md`` section 3a); A2L = ``aimv2_layers.py``, A2M = ``aimv2_models.py``,
MT = ``mammothtok.py``, VT = ``visual_discrete_tokenizer.py``:

- The checkpoint's ``gen_tokenizer.image_tokenizer`` is ``VQVitModel2DPlus_AIMv2`` (VT: ``VisualDiscreteTokenizer``
  builds it with ``VQVitModel2DPlusArgs`` and no ``codebook_size``, so the dataclass defaults 16384 x 8 hold). Its
  encoder is ``aimv2_large_native()`` (A2M): patch 14, width 1024, SwiGLU hidden 2816, 24 blocks, 8 heads, sin-cos
  positions, no head (Identity), every RMSNorm with eps 1e-5.
- ``encoder.preprocessor.patchifier``: ``proj`` Conv2d(3, D, 14, stride 14, bias), flattened row-major to (B, N, D),
  then ``norm`` RMSNorm(D). No cls token. Then the 2-D sin-cos table is added, computed in float32 and cast to the
  tokens' dtype (A2L ``ViTPreprocessor.forward``).
- Sin-cos table (A2L ``SinCosPosEmbed``): ``meshgrid(arange(w), arange(h), indexing="xy")`` puts the COLUMN index in
  the first grid, which feeds the first D/2 channels; the row index feeds the last D/2. Each half is
  ``cat(sin(p * omega), cos(p * omega))`` with ``omega_i = 1 / 10000 ** (i / (D/4))`` for ``i < D/4``.
- ``encoder.trunk.blocks.{i}``: ``x = x + attn(norm_1(x))``, ``x = x + mlp(norm_2(x))``. Attention: ``qkv``
  Linear(D, 3D) and ``proj`` Linear(D, D), both without bias (``Transformer(use_bias=False)``, ``qkv_bias`` False),
  q/k/v split as (3, heads, head_dim) along the output, non-causal SDPA, no mask. MLP ``SwiGLUFFN``:
  ``fc2(silu(fc1 x) * fc3 x)``, no bias, no inner norm. ``encoder.trunk.post_trunk_norm`` RMSNorm(D) at the end.
- AIMv2's RMSNorm (A2L ``RMSNorm``): ``(x * rsqrt(mean(x^2, -1) + eps)).type_as(x) * weight``, written without an
  explicit float32 upcast.
- MT ``encode``: the (B, N, D) output is viewed as (B, H/14, W/14, D) and permuted to channels-first, then
  ``quant_conv`` Conv2d(D, e, 1) with bias, then ``quantize`` (``VectorQuantizer(n_e, e_dim, l2_norm=True)``):
  z and the codebook ``quantize.embedding.weight`` (n_e x e) are each L2-normalised (``F.normalize``, eps 1e-12) and
  ``index = argmin(|z|^2 + |e|^2 - 2 z.e)`` over codes, in (b, h, w) order. The rotation trick, ``post_quant_conv``,
  ``s2ddecoder`` and ``decoder`` play no part in tokenising.

Sizes are configuration here: ``MammothTokConfig``'s defaults are the released sizes (about 309M parameters), and
a root ``config.json`` may carry a ``gen_tokenizer_config`` dict of its fields. That key is ardit's extension: the
released code hard-codes the sizes and its config.json has no such entry, so a checkpoint without it means the
released tokenizer; the key exists so that a tiny tokenizer (tests, CI) can be described.

Numerics. The released model is bf16 and runs under ``torch.autocast("cuda", bfloat16)`` (mamoda2/README.md).
CUDA autocast runs ``pow`` and ``rsqrt`` in float32, so the released RMSNorm in practice normalises in float32 and
rounds to bf16 before the weight multiply; ``aimv2_rms_norm`` does exactly that explicitly (in float32 both
readings are the same arithmetic). Convolutions, linears and attention run in the parameters' dtype, as autocast
runs them in bf16. The quantiser is where the dtype decides the answer: under autocast ``F.normalize`` and the
squares run in float32 but the ``einsum`` for ``z.e`` runs in bf16 and its result is rounded to bf16 (spacing
2^-8 .. 2^-7 near 1), so near-ties between codes are settled by rounding. ardit computes the whole distance in
float32 by default (the nearest code as the formula means it); ``encode(..., released_bf16_distances=True)``
rounds the normalised vectors and the cross term to bf16 as the autocast run does, for parity checks against codes
the released code produced. Measured on an H100 (random weights, width 128, 2 blocks, the released 16384 x 8
codebook, a 448 x 308 image pair, 1408 codes): this module in bf16 without autocast gives ``quant_conv`` outputs
bit-identical to the released op sequence under bf16 autocast; ``released_bf16_distances=True`` then gives the
released codes exactly, and the float32 default differs from them on 6.4% of the codes. So ar_service tokenises an
edit's input with the released rounding whenever MammothTok runs in bf16 (on a GPU, by default:
``edit_image.tokenize_edit_image``), and in float32 throughout when it runs in float32 (a CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Root ``config.json`` key of the tokenizer's sizes (ardit's extension; absent in the released checkpoint).
CONFIG_KEY = "gen_tokenizer_config"
#: Where the image tokenizer's tensors live in a MammothModa2-Dev checkpoint (``Mammothmoda2Model.gen_tokenizer``).
CHECKPOINT_PREFIX = "gen_tokenizer.image_tokenizer."
#: Parts of ``VQVitModel2DPlus_AIMv2`` that exist in the checkpoint but that tokenising never runs.
SKIPPED_PREFIXES = ("decoder.", "post_quant_conv.", "s2ddecoder.")
#: What tokenising reads (relative to ``CHECKPOINT_PREFIX``).
USED_PREFIXES = ("encoder.", "quant_conv.", "quantize.")
POSITION_THETA = 10000.0


@dataclass(frozen=True)
class MammothTokConfig:
    """Sizes of the encoder and quantiser; the defaults are the released ``aimv2_large_native`` + 16384 x 8 codebook."""

    embed_dim: int = 1024
    num_blocks: int = 24
    num_heads: int = 8
    mlp_hidden_dim: int = 2816
    patch_size: int = 14
    num_channels: int = 3
    norm_eps: float = 1e-5
    codebook_embed_dim: int = 8
    codebook_size: int = 16384

    def __post_init__(self) -> None:
        for name in ("embed_dim", "num_blocks", "num_heads", "mlp_hidden_dim", "patch_size", "num_channels",
                     "codebook_embed_dim", "codebook_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{CONFIG_KEY}.{name} must be positive, got {getattr(self, name)}")
        if self.embed_dim % 4:
            raise ValueError(f"{CONFIG_KEY}.embed_dim must be a multiple of 4 (2-D sin-cos positions), got {self.embed_dim}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"{CONFIG_KEY}.embed_dim {self.embed_dim} is not a multiple of num_heads {self.num_heads}")
        if not self.norm_eps > 0:
            raise ValueError(f"{CONFIG_KEY}.norm_eps must be positive, got {self.norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def parameter_count(self) -> int:
        """Parameters of the encoder and quantiser (what ``MammothTok`` holds), from the sizes alone."""
        d, f, p, c, e = self.embed_dim, self.mlp_hidden_dim, self.patch_size, self.num_channels, self.codebook_embed_dim
        patchifier = c * p * p * d + d + d  # proj weight, proj bias, norm
        block = 3 * d * d + d * d + 3 * d * f + 2 * d  # qkv, proj, fc1/fc2/fc3, two norms
        return patchifier + self.num_blocks * block + d + (d * e + e) + self.codebook_size * e

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MammothTokConfig:
        """Fields by name; absent ones take the released sizes; an unknown key is refused by name."""
        data = dict(data or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{CONFIG_KEY} has unknown keys {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            values[name] = float(value) if name == "norm_eps" else int(value)
        return cls(**values)

    @classmethod
    def from_root_config(cls, root_config: Mapping[str, Any]) -> MammothTokConfig:
        """From a checkpoint's root ``config.json``: its ``gen_tokenizer_config`` if present, else the released sizes."""
        entry = root_config.get(CONFIG_KEY)
        if entry is not None and not isinstance(entry, Mapping):
            raise ValueError(f"config.json {CONFIG_KEY} must be an object, got {type(entry).__name__}")
        return cls.from_dict(entry)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def aimv2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """AIMv2's RMSNorm as the released bf16-autocast run computes it: normalise in float32, round to ``x``'s dtype,
    then scale by ``weight`` in that dtype. For float32 inputs this is ``x * rsqrt(mean(x^2) + eps) * weight``."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return aimv2_rms_norm(x, self.weight, self.eps)


def sincos_positions(height: int, width: int, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(height * width, dim) float32, row-major over the grid: the first dim/2 channels encode the column, the last
    dim/2 the row; each half is ``cat(sin(p * omega), cos(p * omega))``, ``omega_i = 10000 ** -(i / (dim/4))``."""
    if dim % 4:
        raise ValueError(f"sin-cos positions need a width that is a multiple of 4, got {dim}")
    # Computed on the CPU and then moved, as the released module does (CPU and CUDA sin/cos may differ in the last bit).
    quarter = dim // 4
    omega = torch.arange(quarter, dtype=torch.float32) / quarter
    omega = 1.0 / POSITION_THETA**omega
    rows = torch.arange(height).repeat_interleave(width).float()
    cols = torch.arange(width).repeat(height).float()

    def half(pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, None] * omega[None, :]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    return torch.cat([half(cols), half(rows)], dim=1).to(device)


class PatchEmbed(nn.Module):
    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(config.num_channels, config.embed_dim, kernel_size=p, stride=p, bias=True)
        self.norm = RMSNorm(config.embed_dim, config.norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(pixels).flatten(2).transpose(1, 2))


class Preprocessor(nn.Module):
    """Patches plus sin-cos positions (no cls token)."""

    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.patchifier = PatchEmbed(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        tokens = self.patchifier(pixels)
        h, w = pixels.shape[2] // self.patch_size, pixels.shape[3] // self.patch_size
        positions = sincos_positions(h, w, tokens.shape[-1], tokens.device)
        return tokens + positions.to(tokens.dtype).unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=False)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class SwiGLUFFN(nn.Module):
    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_hidden_dim, bias=False)
        self.fc2 = nn.Linear(config.mlp_hidden_dim, config.embed_dim, bias=False)
        self.fc3 = nn.Linear(config.embed_dim, config.mlp_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)) * self.fc3(x))


class Block(nn.Module):
    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(config.embed_dim, config.norm_eps)
        self.attn = Attention(config)
        self.norm_2 = RMSNorm(config.embed_dim, config.norm_eps)
        self.mlp = SwiGLUFFN(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class Trunk(nn.Module):
    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_blocks))
        self.post_trunk_norm = RMSNorm(config.embed_dim, config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.post_trunk_norm(x)


class Encoder(nn.Module):
    """AIMv2 native-resolution vision encoder (head: identity): pixels (B, C, H, W) -> features (B, N, D)."""

    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        self.preprocessor = Preprocessor(config)
        self.trunk = Trunk(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.trunk(self.preprocessor(pixels))


def nearest_codes(z: torch.Tensor, codebook: torch.Tensor, released_bf16_distances: bool = False) -> torch.Tensor:
    """Index of the nearest codebook row for each row of ``z`` (M, e), both L2-normalised first:
    ``argmin(|z|^2 + |e|^2 - 2 z.e)`` (the first index on an exact tie, as ``torch.argmin``).

    In float32 throughout by default. ``released_bf16_distances`` reproduces the released bf16-autocast run, whose
    ``einsum`` takes bf16 copies of the normalised vectors and returns ``z.e`` rounded to bf16."""
    z = F.normalize(z.float(), p=2, dim=-1)
    e = F.normalize(codebook.float(), p=2, dim=-1)
    if released_bf16_distances:
        cross = (z.to(torch.bfloat16).float() @ e.to(torch.bfloat16).float().T).to(torch.bfloat16).float()
    else:
        cross = z @ e.T
    distances = z.pow(2).sum(1, keepdim=True) + e.pow(2).sum(1) - 2 * cross
    return distances.argmin(dim=1)


class VectorQuantizer(nn.Module):
    """The codebook (``embedding.weight``, n_e x e); l2-normalised nearest-code lookup."""

    def __init__(self, config: MammothTokConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.codebook_size, config.codebook_embed_dim)

    def forward(self, z: torch.Tensor, released_bf16_distances: bool = False) -> torch.Tensor:
        """z (B, e, h, w) -> codes (B, h, w), int64."""
        b, e, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(b * h * w, e)
        return nearest_codes(flat, self.embedding.weight, released_bf16_distances).view(b, h, w)


class MammothTokMismatch(ValueError):
    """The tensors given and the tokenizer's parameters disagree; the message names the keys."""


@dataclass(frozen=True)
class LoadReport:
    """Names (relative to the tokenizer) that a load took, and the checkpoint parts it deliberately left."""

    loaded: tuple[str, ...]
    skipped: tuple[str, ...]


class MammothTok(nn.Module):
    """Encoder + ``quant_conv`` + quantiser of ``VQVitModel2DPlus_AIMv2``, under the released module names, so the
    checkpoint's ``gen_tokenizer.image_tokenizer.*`` tensors load by name."""

    def __init__(self, config: MammothTokConfig | None = None) -> None:
        super().__init__()
        self.config = config or MammothTokConfig()
        self.encoder = Encoder(self.config)
        self.quant_conv = nn.Conv2d(self.config.embed_dim, self.config.codebook_embed_dim, kernel_size=1, bias=True)
        self.quantize = VectorQuantizer(self.config)

    @classmethod
    def from_config(cls, config: MammothTokConfig | Mapping[str, Any] | None = None) -> MammothTok:
        """From a ``MammothTokConfig``, a ``gen_tokenizer_config``-style dict, or nothing (the released sizes)."""
        if not isinstance(config, MammothTokConfig):
            config = MammothTokConfig.from_dict(config)
        return cls(config)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def grid_size(self, height: int, width: int) -> tuple[int, int]:
        """Code grid (rows, columns) of an image of ``height`` x ``width`` pixels, which must be patch multiples."""
        p = self.config.patch_size
        if height < p or width < p or height % p or width % p:
            raise ValueError(f"image size {height}x{width} (HxW) is not a positive multiple of the {p}-pixel patch")
        return height // p, width // p

    def _check_pixels(self, pixels: torch.Tensor) -> tuple[int, int]:
        if pixels.dim() != 4 or pixels.shape[1] != self.config.num_channels:
            raise ValueError(f"pixels must be (B, {self.config.num_channels}, H, W), got {tuple(pixels.shape)}")
        return self.grid_size(pixels.shape[2], pixels.shape[3])

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``quant_conv`` output (B, e, h, w), in the parameters' dtype: what the quantiser reads."""
        h, w = self._check_pixels(pixels)
        pixels = pixels.to(self.quant_conv.weight.dtype)
        tokens = self.encoder(pixels)
        grid = tokens.reshape(tokens.shape[0], h, w, tokens.shape[2]).permute(0, 3, 1, 2)
        return self.quant_conv(grid)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, released_bf16_distances: bool = False) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1], H and W multiples of the patch -> codes (B, H/patch, W/patch), int64,
        each in ``[0, codebook_size)``. Deterministic for given weights, input, device and dtype."""
        return self.quantize(self.features(pixels), released_bf16_distances)


def _describe(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def key_report(expected: set[str], found: list[str] | set[str]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, skipped): names relative to ``CHECKPOINT_PREFIX``; skipped ones lie under
    ``SKIPPED_PREFIXES`` (the decoder side) and are neither missing nor unexpected."""
    skipped = sorted(n for n in found if n.startswith(SKIPPED_PREFIXES))
    rest = set(found).difference(skipped)
    return sorted(expected - rest), sorted(rest - expected), skipped


def _mismatch(config: MammothTokConfig, prefix: str, missing: list[str], unexpected: list[str],
              wrong: list[str]) -> MammothTokMismatch:
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {_describe([prefix + n for n in missing])}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {_describe([prefix + n for n in unexpected])}")
    if wrong:
        parts.append(f"wrong shape {len(wrong)}: {_describe(wrong)}")
    return MammothTokMismatch(
        f"MammothTok tensors do not match its config (width {config.embed_dim}, {config.num_blocks} blocks, "
        f"mlp {config.mlp_hidden_dim}, codebook {config.codebook_size} x {config.codebook_embed_dim}): " + "; ".join(parts)
    )


def load_state(model: MammothTok, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> LoadReport:
    """Strict load of ``tensors`` (names under ``prefix``, e.g. ``CHECKPOINT_PREFIX`` for a whole checkpoint's
    dict) into ``model``, copying into its parameters (their device and dtype). Names outside ``prefix`` are ignored;
    decoder-side names are skipped and reported; a missing, unexpected or wrongly shaped tensor fails the load, naming
    every such key (with ``prefix``)."""
    relative = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    expected = model.state_dict()
    missing, unexpected, skipped = key_report(set(expected), list(relative))
    wrong = sorted(
        f"{prefix}{n} {tuple(relative[n].shape)} != {tuple(expected[n].shape)}"
        for n in set(relative) & set(expected)
        if tuple(relative[n].shape) != tuple(expected[n].shape)
    )
    if missing or unexpected or wrong:
        raise _mismatch(model.config, prefix, missing, unexpected, wrong)
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(relative[name])
    return LoadReport(loaded=tuple(sorted(expected)), skipped=tuple(skipped))


def build_mammothtok(config: MammothTokConfig, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> MammothTok:
    """The module tree with uninitialised storage on ``device`` (no initialisation pass over 309M parameters)."""
    with torch.device("meta"):
        model = MammothTok(config)
    return model.to_empty(device=device).to(dtype)


def load_mammothtok(
    checkpoint: Any,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] | None = None,
) -> tuple[MammothTok, LoadReport]:
    """Build from ``checkpoint.config`` (a ``servicekit.checkpoint.PipelineCheckpoint``) and load its
    ``gen_tokenizer.image_tokenizer.*`` tensors strictly. The key check runs on names before a tensor is read; only
    the encoder, ``quant_conv`` and the codebook are read; the decoder side is reported as skipped."""
    config = MammothTokConfig.from_root_config(checkpoint.config)
    model = build_mammothtok(config, device, dtype)
    names = [n[len(CHECKPOINT_PREFIX):] for n in checkpoint.tensor_names(CHECKPOINT_PREFIX)]
    missing, unexpected, skipped = key_report(set(model.state_dict()), names)
    if missing or unexpected:
        raise _mismatch(config, CHECKPOINT_PREFIX, missing, unexpected, [])
    tensors: dict[str, torch.Tensor] = {}
    for sub in USED_PREFIXES:
        for name, tensor in checkpoint.load_tensors(CHECKPOINT_PREFIX + sub, device, dtype).items():
            tensors[sub + name] = tensor
    report = LoadReport(loaded=load_state(model, tensors).loaded, skipped=tuple(skipped))
    if log is not None and skipped:
        log(f"not loading {len(skipped)} tensors under {CHECKPOINT_PREFIX}{{{', '.join(SKIPPED_PREFIXES)}}} "
            "(MammothTok's decoder side: not used to tokenise an input image)")
    return model.eval(), report


def init_random_(model: MammothTok, seed: int = 0, std: float = 0.02) -> MammothTok:
    """Random weights in place, deterministic for a seed (drawn on the CPU): normal(0, std) matrices, zero biases,
    norm weights near 1, codebook rows uniform on the sphere. For tests and tiny checkpoints."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight")):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            elif name.endswith(".bias"):
                values = torch.zeros(param.shape)
            elif name == "quantize.embedding.weight":
                values = F.normalize(torch.randn(param.shape, generator=generator), dim=-1)
            else:
                values = std * torch.randn(param.shape, generator=generator)
            param.copy_(values)
    return model
