"""The DiT stage as one object: built from a MammothModa2 checkpoint's config, weights loaded strictly, then
denoise and decode.

Layout (servicekit/checkpoint.py): the root config.json's ``gen_dit_config`` / ``gen_vae_config`` /
``gen_image_condition_refiner_config`` / ``gen_condition_mode`` and the tensors under ``gen_transformer.``,
``gen_vae.`` and ``gen_image_condition_refiner.`` — what bytedance/mammothmoda ``modeling_mammothmoda2.py``
(``Mammothmoda2Model.__init__``) builds and vllm-omni ``pipeline_mammothmoda2_dit.py`` loads. Which conditions the
DiT sees follows upstream ``t2i_utils.py`` ``encode_full_prompts``: the text condition when "text" is in
``gen_condition_mode``, the image condition (through the Q-Former refiner when there is one) when "image" is,
concatenated [text | image]. The unconditional branch is the caller's (an empty condition, as vllm-omni, or the
negative prompt's text condition); it never goes through the refiner.

Two layouts, told apart by ``gen_dit_config.is_image_embedder``:
- Preview (bytedance/mammothmoda qwen25vl): the Q-Former refiner beside the DiT (``gen_image_condition_refiner.*``,
  built when ``gen_image_condition_refiner_config`` is not null), in the LLM's width; [text | refined image] then
  goes through the DiT's caption embedder at every step.
- Dev (main ``mamoda2/``): the Q-Former inside the DiT (``gen_transformer.time_caption_embed.image_embedder.*``,
  sized by ``gen_image_condition_refiner_config``, which must then be an object), from the LLM's width to the DiT's.
  The conditional context is [caption_embedder(text) | Q-Former(image)] and the unconditional one
  caption_embedder(negative); both are computed once per request (``branch_conditions``) and every step takes them
  as they are. Its condition mode is ``text_image`` whatever config.json says: the released Dev code takes it from
  ``decode_diffusion_image``'s argument (``mamoda2/mammothmoda2/utils/t2i_utils.py`` 287, 331) and never reads
  ``config.gen_condition_mode``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL  # not `from diffusers`: type checkers see a placeholder there

from dit_service.model.cuda_graphs import GraphedTransformer
from dit_service.model.preview import LatentPreviewer
from dit_service.model.refiner import ImageConditionRefiner
from dit_service.model.sampler import (
    CFG_MODES,
    CFG_RANGE_POLICIES,
    DenoiseEntry,
    DenoiseResult,
    denoise,
    start_entry,
    step_entries,
)
from dit_service.model.transformer import MammothDiT, quantize_fp8_
from dit_service.model.weights import load_strict, materialize, random_init_
from servicekit.fp8 import check_quantization

if TYPE_CHECKING:
    from servicekit.checkpoint import PipelineCheckpoint

DIT_PREFIX = "gen_transformer."
VAE_PREFIX = "gen_vae."
REFINER_PREFIX = "gen_image_condition_refiner."
CONDITION_MODES = ("text", "image", "text_image")
DEFAULT_CONDITION_MODE = "image"  # Mammothmoda2Config's default (configuration_mammothmoda2.py)
#: The Dev layout's condition mode: ``decode_diffusion_image``'s default (main ``mamoda2/mammothmoda2/utils/
#: t2i_utils.py`` 287), the only one the released Dev code renders with unless a caller passes another.
DEV_CONDITION_MODE = "text_image"
IMAGE_EMBEDDER_PREFIX = DIT_PREFIX + "time_caption_embed.image_embedder."

log = logging.getLogger(__name__)


def llm_hidden_size(config: dict) -> int:
    """The AR's hidden size: llm_config.text_config.hidden_size (Qwen2.5-VL layout) or llm_config.hidden_size."""
    llm = config.get("llm_config") or {}
    for source in (llm.get("text_config") or {}, llm):
        if source.get("hidden_size"):
            return int(source["hidden_size"])
    raise ValueError("config.json: llm_config has no text_config.hidden_size (the condition width of the DiT)")


def dev_layout(config: dict) -> bool:
    """Whether a root config describes the Dev DiT layout: the Q-Former inside the DiT (``gen_dit_config.
    is_image_embedder``, diffusion_transformer.py 271, 308)."""
    return bool((config.get("gen_dit_config") or {}).get("is_image_embedder", False))


def build_modules(config: dict) -> tuple[MammothDiT, AutoencoderKL, ImageConditionRefiner | None]:
    """The DiT stage's modules on the meta device (no storage): shapes only, from the root config. In the Dev layout
    ``gen_image_condition_refiner_config`` sizes the Q-Former inside the DiT and there is no refiner beside it."""
    for key in ("gen_dit_config", "gen_vae_config"):
        if not config.get(key):
            raise ValueError(f"config.json has no {key}")
    hidden = llm_hidden_size(config)
    vae_config = {k: v for k, v in config["gen_vae_config"].items() if not k.startswith("_")}
    refiner_config = config.get("gen_image_condition_refiner_config")
    dev = dev_layout(config)
    if dev and not isinstance(refiner_config, dict):
        raise ValueError(
            "config.json: gen_dit_config.is_image_embedder is true (the Dev layout: the Q-Former inside the DiT), so "
            "gen_image_condition_refiner_config must be an object sizing that Q-Former ({} for its defaults, 128 "
            f"queries and 2 layers), as the released code splats it (modeling_mammothmoda2.py 220); got {refiner_config!r}"
        )
    with torch.device("meta"):
        dit = MammothDiT.from_config(config["gen_dit_config"], hidden, image_embedder_config=refiner_config if dev else None)
        vae = AutoencoderKL.from_config(vae_config)
        refiner = None
        if refiner_config is not None and not dev:
            refiner = ImageConditionRefiner.from_config(refiner_config, hidden)
    return dit, vae, refiner


def check_layout_tensors(config: dict, tensor_names: Callable[[str], list[str]]) -> None:
    """Refuses a checkpoint whose tensors belong to the other layout than its config.json, before any is read: a Dev
    config (Q-Former inside the DiT) beside Preview's top-level refiner tensors, or a Preview config beside the Dev
    Q-Former's. ``tensor_names(prefix)``: the checkpoint's tensor names under a prefix."""
    if dev_layout(config):
        stray = tensor_names(REFINER_PREFIX)
        if stray:
            raise ValueError(
                f"config.json describes the Dev layout (gen_dit_config.is_image_embedder: the Q-Former inside the DiT, "
                f"under {IMAGE_EMBEDDER_PREFIX}*), but the checkpoint also holds {len(stray)} tensors of a Preview "
                f"refiner beside the DiT ({stray[0]}, ...): a checkpoint is one layout or the other"
            )
    else:
        stray = tensor_names(IMAGE_EMBEDDER_PREFIX)
        if stray:
            raise ValueError(
                f"the checkpoint holds {len(stray)} tensors of a Q-Former inside the DiT ({stray[0]}, ...), the Dev "
                "layout, but config.json's gen_dit_config has no is_image_embedder: true"
            )


class DiTPipeline:
    """Holds the loaded modules; stateless between calls (every render computes its own schedule)."""

    def __init__(
        self,
        transformer: MammothDiT,
        vae: AutoencoderKL,
        refiner: ImageConditionRefiner | None,
        condition_mode: str,
        device,
        dtype: torch.dtype,
        cfg_range_policy: str = "per_step",
    ):
        """``cfg_range_policy``: how cfg_range switches guidance (``sampler.uses_cfg``); a checkpoint's
        ``ardit_serving.json`` setting (servicekit ServingDefaults)."""
        if condition_mode not in CONDITION_MODES:
            raise ValueError(f"gen_condition_mode must be one of {', '.join(CONDITION_MODES)}; got {condition_mode!r}")
        if refiner is not None and transformer.is_image_embedder:
            raise ValueError("a DiT that holds the Q-Former (is_image_embedder, Dev) takes no refiner beside it (Preview)")
        self.transformer = transformer.eval().requires_grad_(False)
        self.vae = vae.eval().requires_grad_(False)
        self.refiner = None if refiner is None else refiner.eval().requires_grad_(False)
        self.condition_mode = condition_mode
        if cfg_range_policy not in CFG_RANGE_POLICIES:
            raise ValueError(f"cfg_range_policy must be one of {', '.join(CFG_RANGE_POLICIES)}; got {cfg_range_policy!r}")
        self.cfg_range_policy = cfg_range_policy
        self.device = torch.device(device)
        self.dtype = dtype
        # CUDA: a CFG pair (or a step batch) runs its joint layers on the valid rows only, packed back to back.
        self.transformer.pack_samples = self.device.type == "cuda"
        # What a denoise step calls: the transformer itself, or its CUDA graphs (use_cuda_graphs).
        self.step_model: Callable[..., torch.Tensor] = self.transformer
        self._previewer: LatentPreviewer | None = None  # fitted to the VAE on first use (preview.py)

    def quantize(self, quantization: str) -> None:
        """``quantization`` "fp8": the transformer's block linears become FP8 matmuls (``transformer.quantize_fp8_``);
        "none" leaves the model as loaded. Call before ``use_cuda_graphs`` and ``warm_up``."""
        check_quantization(quantization)
        if quantization == "fp8":
            quantize_fp8_(self.transformer)

    def use_cuda_graphs(self, max_graphs: int) -> None:
        """Replays the denoise step's transformer call from CUDA graphs (cuda_graphs.py); no effect off CUDA or with
        ``max_graphs`` 0."""
        if self.device.type == "cuda" and max_graphs > 0:
            self.step_model = GraphedTransformer(self.transformer, max_graphs)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: PipelineCheckpoint,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        random_weights: bool = False,
        seed: int = 0,
    ) -> DiTPipeline:
        """Builds from ``checkpoint.config`` and loads ``gen_*`` tensors strictly (missing/unexpected keys fail).

        ``random_weights=True`` reads no tensors: every module is allocated straight on ``device`` in ``dtype`` and
        randomly initialised there (the Preview-shaped benchmark mode)."""
        if not random_weights:
            check_layout_tensors(checkpoint.config, checkpoint.tensor_names)
        pipeline = cls.from_config(
            checkpoint.config, device, dtype, random_weights=random_weights, seed=seed,
            load=None if random_weights else checkpoint.load_tensors,
        )
        pipeline.cfg_range_policy = checkpoint.serving.cfg_range_policy
        return pipeline

    @classmethod
    def from_config(cls, config: dict, device="cpu", dtype=torch.float32, random_weights=False, seed=0, load=None):
        dit, vae, refiner = build_modules(config)
        parts: list[tuple[str, torch.nn.Module]] = [(DIT_PREFIX, dit), (VAE_PREFIX, vae)]
        if refiner is not None:
            parts.append((REFINER_PREFIX, refiner))
        for i, (prefix, module) in enumerate(parts):
            if random_weights:
                random_init_(materialize(module, device, dtype), seed=seed + i)
            else:
                if load is None:
                    raise ValueError("from_config needs load(prefix, device, dtype) unless random_weights=True")
                load_strict(module, load(prefix, device, dtype), prefix)
            leftover = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta]
            leftover += [n for n, b in module.named_buffers() if b.is_meta]
            if leftover:
                raise ValueError(f"{prefix}: tensors left without storage after loading: {leftover}")
        mode = config.get("gen_condition_mode") or DEFAULT_CONDITION_MODE
        if dit.is_image_embedder:
            if mode != DEV_CONDITION_MODE:
                log.warning("config.json gen_condition_mode %r is not read for the Dev layout: the released Dev code "
                            "renders with %r (t2i_utils.py 287)", mode, DEV_CONDITION_MODE)
            mode = DEV_CONDITION_MODE
        return cls(dit, vae, refiner, mode, device, dtype)

    # -- geometry ---------------------------------------------------------------------------------------------

    @property
    def condition_dim(self) -> int:
        """Width of the condition rows the DiT accepts: the LLM hidden size."""
        return self.transformer.condition_dim

    @property
    def requires_image_condition(self) -> bool:
        """Whether a render needs image-condition rows: the Dev layout's Q-Former has no output without them (the
        released code always has some: the generated grid and its header and end tokens), so an empty image
        condition is refused rather than rendered without the Q-Former's tokens."""
        return self.transformer.is_image_embedder and "image" in self.condition_mode

    @property
    def latent_channels(self) -> int:
        return self.vae.config["latent_channels"]

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config["block_out_channels"]) - 1)

    @property
    def patch_size(self) -> int:
        return self.transformer.patch_size

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

    @torch.no_grad()
    def assemble_condition(self, text_condition: torch.Tensor, image_condition: torch.Tensor) -> torch.Tensor:
        """The conditional branch's condition as a denoise step takes it: [text | image] per gen_condition_mode, the
        image part through the refiner when the model has one (Preview: rows in the LLM's width). In the Dev layout
        the context in the DiT's width, [caption_embedder(text) | Q-Former(image)] (``MammothDiT.context``)."""
        if self.transformer.is_image_embedder:
            return self.transformer.context(
                text_condition if "text" in self.condition_mode else None,
                image_condition if "image" in self.condition_mode else None,
            )
        parts = []
        if "text" in self.condition_mode:
            parts.append(text_condition.to(device=self.device, dtype=self.dtype))
        if "image" in self.condition_mode:
            image = image_condition.to(device=self.device, dtype=self.dtype)
            if self.refiner is not None and image.shape[0] > 0:  # an empty image condition skips it (vllm-omni)
                image = self.refiner(image[None])[0]
            parts.append(image)
        if not parts:
            return text_condition.new_zeros(0, self.condition_dim).to(device=self.device, dtype=self.dtype)
        return torch.cat(parts, dim=0)

    @torch.no_grad()
    def unconditional_condition(self, uncond_condition: torch.Tensor) -> torch.Tensor:
        """The unconditional branch's condition as a denoise step takes it: the negative rows themselves, or in the Dev
        layout caption_embedder(negative rows), never with Q-Former tokens (t2i_utils.py 228-244, 253-260)."""
        if self.transformer.is_image_embedder:
            return self.transformer.context(uncond_condition, None)
        return uncond_condition.to(device=self.device, dtype=self.dtype)

    def branch_conditions(
        self, text_condition: torch.Tensor, image_condition: torch.Tensor, uncond_condition: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conditional, unconditional) condition of one request, as every denoise step of each of its images takes
        them: computed once (refiner, Q-Former, Dev caption embedding). Conditions are [positions, condition_dim];
        any may have 0 rows, except an image condition the Dev layout's Q-Former needs (``requires_image_condition``)."""
        for name, tensor in (("text_condition", text_condition), ("image_condition", image_condition),
                             ("uncond_condition", uncond_condition)):
            if tensor.ndim != 2 or tensor.shape[1] != self.condition_dim:
                raise ValueError(f"{name} must be [positions, {self.condition_dim}]; got {tuple(tensor.shape)}")
        if self.requires_image_condition and image_condition.shape[0] == 0:
            raise ValueError(
                "this model's DiT holds the Q-Former image embedder (Dev layout), which needs at least one "
                "image-condition row"
            )
        return self.assemble_condition(text_condition, image_condition), self.unconditional_condition(uncond_condition)

    def render_latents(
        self,
        text_condition: torch.Tensor,
        image_condition: torch.Tensor,
        uncond_condition: torch.Tensor,
        width: int,
        height: int,
        seed: int,
        steps: int,
        guidance: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        cfg_mode: str = "sequential",
        on_step: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> DenoiseResult:
        """Denoises one image's latents. Conditions are as ``branch_conditions`` takes them."""
        if cfg_mode not in CFG_MODES:
            raise ValueError(f"cfg_mode must be one of {', '.join(CFG_MODES)}; got {cfg_mode!r}")
        latent_shape = self.latent_shape(width, height)
        condition, uncond = self.branch_conditions(text_condition, image_condition, uncond_condition)
        return denoise(
            self.step_model,
            condition,
            uncond,
            latent_shape,
            seed=seed,
            steps=steps,
            guidance=guidance,
            cfg_range=cfg_range,
            cfg_mode=cfg_mode,
            on_step=on_step,
            should_stop=should_stop,
            device=self.device,
            dtype=self.dtype,
            cfg_range_policy=self.cfg_range_policy,
        )

    def start_entry(
        self,
        text_condition: torch.Tensor,
        image_condition: torch.Tensor,
        uncond_condition: torch.Tensor,
        width: int,
        height: int,
        seed: int,
        steps: int,
        guidance: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        cache_threshold: float = 0.0,
        references: list[torch.Tensor] | None = None,
        image_guidance: float = 1.0,
    ) -> DenoiseEntry:
        """One image ready to join a running batch (step-level batching): seeded noise and its own schedule.
        ``cache_threshold``: step caching (sampler.step_entries), 0 = off. ``references``, ``image_guidance``: an
        edit's (``start_prepared_entry``)."""
        conditions = self.branch_conditions(text_condition, image_condition, uncond_condition)
        return self.start_prepared_entry(conditions, width, height, seed, steps, guidance, cfg_range, cache_threshold,
                                         references=references, image_guidance=image_guidance)

    def start_prepared_entry(
        self,
        conditions: tuple[torch.Tensor, torch.Tensor],
        width: int,
        height: int,
        seed: int,
        steps: int,
        guidance: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        cache_threshold: float = 0.0,
        references: list[torch.Tensor] | None = None,
        image_guidance: float = 1.0,
    ) -> DenoiseEntry:
        """``start_entry`` from a request's ``branch_conditions``: the images of one request share them.
        ``references``: an edit's reference latents (``sample_references``), which every step of the conditional and
        the reference branch takes; ``image_guidance``: the image guidance scale (forced to 1 without references, as
        t2i_utils.py 342-344)."""
        condition, uncond = conditions
        if references is not None:
            if not references or len(references) > self.max_reference_images:
                raise ValueError(f"an edit takes 1 to {self.max_reference_images} reference latents; got {len(references)}")
            p = self.patch_size
            for j, ref in enumerate(references):
                if ref.ndim != 3 or ref.shape[0] != self.latent_channels or ref.shape[1] % p or ref.shape[2] % p:
                    raise ValueError(f"reference latent {j} must be [{self.latent_channels}, h, w] with h and w "
                                     f"multiples of {p}; got {tuple(ref.shape)}")
        return start_entry(
            condition, uncond, self.latent_shape(width, height), seed, steps, guidance, (cfg_range[0], cfg_range[1]),
            device=self.device, dtype=self.dtype, cfg_range_policy=self.cfg_range_policy, cache_threshold=cache_threshold,
            references=references, image_guidance=image_guidance,
        )

    # -- editing: reference images -------------------------------------------------------------------------------------

    @property
    def max_reference_images(self) -> int:
        """How many reference images a render may carry: the Dev layout's DiT takes up to its image_index_embedding's
        rows (5); the Preview layout serves text to image only (0)."""
        return self.transformer.image_index_embedding.shape[0] if self.transformer.is_image_embedder else 0

    @torch.no_grad()
    def encode_references(self, images: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Preprocessed reference images ([3, H, W] in [-1, 1], dit_service/references.py) -> the VAE posterior of each,
        (mean, std) float32 [C, H/8, W/8] on the CPU: the encoder runs once per render (modeling_mammothmoda2.py
        176-198 encodes each reference once and gives the latents to every output row, t2i_utils.py 337-346)."""
        posteriors = []
        for j, image in enumerate(images):
            if image.ndim != 3 or image.shape[0] != 3:
                raise ValueError(f"reference image {j} must be [3, H, W]; got {tuple(image.shape)}")
            x = image[None].to(device=self.device, dtype=self.dtype)
            dist = self.vae.encode(x).latent_dist
            posteriors.append((dist.mean[0].float().cpu(), dist.std[0].float().cpu()))
        return posteriors

    def sample_references(self, posteriors: list[tuple[torch.Tensor, torch.Tensor]], seed: int) -> list[torch.Tensor]:
        """Each reference's latents for the image of ``seed``: a draw from its VAE posterior, mean + std * noise, then
        (z - shift_factor) * scaling_factor (modeling_mammothmoda2.py 176-198, ``_apply_vae_scaling``).

        The released code draws with ``latent_dist.sample()`` from the global RNG, so an edit is not reproducible
        there; here the noise comes from a CPU generator seeded from the image's seed and the reference's index
        (``reference_seed``, a stream apart from the initial noise's), so the same seed gives the same image on any
        device, alone or batched, and split or not (index_offset). Float32, on the CPU; the transformer casts."""
        config = self.vae.config
        latents = []
        for j, (mean, std) in enumerate(posteriors):
            generator = torch.Generator("cpu").manual_seed(reference_seed(seed, j))
            z = mean + std * torch.randn(mean.shape, generator=generator, dtype=torch.float32)
            if config.get("shift_factor") is not None:
                z = z - config["shift_factor"]
            if config.get("scaling_factor") is not None:
                z = z * config["scaling_factor"]
            latents.append(z)
        return latents

    def step(self, entries: list[DenoiseEntry], separate: bool = False) -> int:
        """One Euler step for every entry (same latent shape), in one transformer call unless ``separate``."""
        return step_entries(
            self.step_model, entries, self.dtype, separate=separate, indicator=self.transformer.cache_indicator
        )

    def synchronize(self) -> None:
        """Waits for the work queued on the device, so that a measured time (warm_up's, a benchmark's) is the device's
        and not only the time it took to issue the work (a replayed CUDA graph returns at once)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up(self) -> float:
        """Runs what a render runs, once, on made-up inputs (a guided and an unguided denoise step, the refiner, the
        VAE decode, a preview; for a DiT that takes references, an edit's VAE encode and three-way step); returns the
        seconds it took. The first call of the fused kernels compiles them (torch.compile, dynamic shapes) and cuDNN
        and cuBLAS set up on first use: without this, the first request pays for it. One step per call signature, so
        no CUDA graph is captured for these shapes. Only the previewer's fit to the VAE is kept."""
        started = time.perf_counter()
        side = 4 * self.size_multiple
        generator = torch.Generator().manual_seed(0)
        text, image = (torch.randn(8, self.condition_dim, generator=generator) for _ in range(2))
        empty = text.new_zeros(0, self.condition_dim)
        for guidance in (2.0, 1.0):  # two rows (CFG) and one row take different kernels
            entry = self.start_entry(text, image, empty, side, side, seed=0, steps=1, guidance=guidance)
            self.step([entry])
        if self.max_reference_images:  # an edit: the VAE encoder and the reference refiner, three-way guidance
            references = self.sample_references(self.encode_references([torch.zeros(3, side, side)]), 0)
            edit = self.start_entry(text, image, empty, side, side, seed=0, steps=1, guidance=2.0,
                                    references=references, image_guidance=2.0)
            self.step([edit])
        self.decode(entry.latents)
        self.preview(entry)
        self.synchronize()
        return time.perf_counter() - started

    @property
    def previewer(self) -> LatentPreviewer:
        """The latent-to-RGB map fitted to this pipeline's VAE (once; deterministic)."""
        if self._previewer is None:
            self._previewer = LatentPreviewer.fit(self.vae, self.device, self.dtype)
        return self._previewer

    def preview(self, entry: DenoiseEntry) -> np.ndarray:
        """uint8 pixels [H, W, 3] of the image ``entry``'s last step predicts, at the final image's size, without the
        VAE decoder (preview.py)."""
        return self.previewer.pixels(entry.predicted_data())

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [1,C,h,w] or [C,h,w] -> uint8 pixels [H,W,3]: z / scaling_factor + shift_factor, VAE decode,
        then [-1, 1] -> [0, 255] rounded (t2i_utils.py ``processing`` and diffusers' VaeImageProcessor)."""
        if latents.ndim == 3:
            latents = latents[None]
        if latents.shape[0] != 1:
            raise ValueError(f"decode takes one image; got batch {latents.shape[0]}")
        config = self.vae.config
        z = latents.to(device=self.device, dtype=self.dtype)
        if config["scaling_factor"] is not None:
            z = z / config["scaling_factor"]
        if config.get("shift_factor") is not None:
            z = z + config["shift_factor"]
        image = self.vae.decode(z, return_dict=False)[0][0].float().clamp(-1, 1)
        pixels = ((image + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(1, 2, 0).cpu().numpy()


def reference_seed(seed: int, index: int) -> int:
    """The seed of reference ``index``'s posterior draw for the image of ``seed``: splitmix64 of both, so that it is
    never the initial noise's seed (the same shape would otherwise draw the same numbers)."""
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


# -- Preview shapes -----------------------------------------------------------------------------------------------

# black-forest-labs/FLUX.1 vae/config.json: the 16-channel AutoencoderKL the DiT's latent space is shaped for.
FLUX_VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}

# Preview's DiT depth is not published in the code we could read. 16 joint layers + 2 layers in each of the three
# refiners gives 2.29B DiT parameters; with the 128-query, 2-layer Q-Former at width 3584 (0.53B) and the Flux VAE
# (0.08B) the DiT stage holds 2.90B parameters = 5.41 GiB in bf16, against the 5.49 GiB vllm-omni's recipe reports
# for the DiT stage's weights. Hidden 2520, 21/7 heads, head_dim 120 = 40+40+40 and F = 10240 are the references'.
PREVIEW_NUM_LAYERS = 16


def preview_gen_parts(llm_hidden_size: int = 3584) -> dict:
    """The DiT-side config.json entries of a MammothModa2-Preview-shaped checkpoint (no tensors)."""
    return {
        "gen_dit_config": {
            "_class_name": "Transformer2DModel",
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": None,
            "hidden_size": 2520,
            "num_layers": PREVIEW_NUM_LAYERS,
            "num_refiner_layers": 2,
            "num_attention_heads": 21,
            "num_kv_heads": 7,
            "multiple_of": 256,
            "ffn_dim_multiplier": None,
            "norm_eps": 1e-5,
            "axes_dim_rope": [40, 40, 40],
            "axes_lens": [10000, 10000, 10000],
            "text_feat_dim": llm_hidden_size,
            "timestep_scale": 1.0,
        },
        "gen_vae_config": dict(FLUX_VAE_CONFIG),
        "gen_image_condition_refiner_config": {"num_queries": 128, "num_layers": 2},
        "gen_axes_dim_rope": [40, 40, 40],
        "gen_axes_lens": [10000, 10000, 10000],
        "gen_transport_config": {},
        "gen_condition_mode": "text_image",
    }


def preview_dit_config(llm_hidden_size: int = 3584) -> dict:
    """A root config with only what the DiT stage reads (the LLM's hidden size and the gen_* parts): enough to build
    the Preview-shaped DiT stage with random weights, as the GPU benchmarks do."""
    return {"llm_config": {"text_config": {"hidden_size": llm_hidden_size}}, **preview_gen_parts(llm_hidden_size)}


# -- Dev shapes ---------------------------------------------------------------------------------------------------

# The Dev release's gen_dit_config and gen_image_condition_refiner_config are not published (config.json lives only in
# the Hugging Face repo): UNVERIFIED. Taken: Preview's DiT dimensions (the README's "2B dense DiT" for both) with the
# Q-Former inside it, at the SimpleQFormerImageEmbedder defaults (128 queries, 2 layers; image_refiner.py 98-107),
# and the Qwen3-VL-8B hidden size 4096 as its input width.
DEV_IMAGE_EMBEDDER_CONFIG = {"num_queries": 128, "num_layers": 2}


def dev_gen_parts(llm_hidden_size: int = 4096) -> dict:
    """The DiT-side config.json entries of a MammothModa2-Dev-shaped checkpoint (no tensors): Preview's DiT with
    ``is_image_embedder`` and a 128-query, 2-layer Q-Former inside it; no refiner beside it. Unverified sizes."""
    parts = preview_gen_parts(llm_hidden_size)
    parts["gen_dit_config"] = dict(parts["gen_dit_config"], is_image_embedder=True)
    parts["gen_image_condition_refiner_config"] = dict(DEV_IMAGE_EMBEDDER_CONFIG)
    parts["gen_condition_mode"] = DEV_CONDITION_MODE
    return parts


def dev_dit_config(llm_hidden_size: int = 4096) -> dict:
    """``preview_dit_config`` for the Dev shapes: enough of a root config to build the Dev-shaped DiT stage."""
    return {"llm_config": {"text_config": {"hidden_size": llm_hidden_size}}, **dev_gen_parts(llm_hidden_size)}


def parameter_counts(config: dict) -> dict[str, int]:
    """Parameters per DiT-stage component of a root config, counted on the meta device (nothing allocated). In the
    Dev layout the Q-Former is part of ``gen_transformer``; its share is also given, under its own prefix, outside
    ``total``."""
    dit, vae, refiner = build_modules(config)
    count = lambda m: 0 if m is None else sum(p.numel() for p in m.parameters())  # noqa: E731
    counts = {"gen_transformer": count(dit), "gen_vae": count(vae), "gen_image_condition_refiner": count(refiner)}
    counts["total"] = sum(counts.values())
    if dit.is_image_embedder:
        counts[IMAGE_EMBEDDER_PREFIX.rstrip(".")] = count(dit.time_caption_embed.image_embedder)
    return counts
