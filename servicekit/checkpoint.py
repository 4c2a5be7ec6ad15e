"""A pipeline checkpoint directory in the upstream MammothModa2 layout, and its weights.

One combined root: ``config.json`` (model_type ``mammothmoda2``: ``llm_config``, ``gen_dit_config``,
``gen_vae_config``, ``gen_image_condition_refiner_config``, ``gen_axes_dim_rope``, ...),
``t2i_generation_config.json``, tokenizer files, and safetensors weights — one ``model.safetensors``
or shards listed in ``model.safetensors.index.json`` — whose keys carry the component prefixes
``llm_model.``, ``gen_transformer.``, ``gen_vae.`` and ``gen_image_condition_refiner.``.
Each service opens the same directory and reads only the tensors under its own prefixes.

Serving facts that the upstream checkpoint does not hold live in an optional ``ardit_serving.json``
beside it (see ``ServingDefaults``); a real checkpoint needs none.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
SERVING_FILE = "ardit_serving.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
FAMILIES = ("mammothmoda2",)
#: The released members of the mammothmoda2 family and what config.json says of each: the AR's ``llm_config.model_type``
#: and whether the DiT holds the Q-Former image embedder (``gen_dit_config.is_image_embedder``). Preview: Qwen2.5-VL
#: AR, Q-Former beside the DiT (bytedance/mammothmoda qwen25vl ``mammothmoda2/model/modeling_mammothmoda2.py``
#: 139-142); Dev: Qwen3-VL AR, Q-Former inside the DiT (main ``mamoda2/mammothmoda2/model/modeling_mammothmoda2.py``
#: 212-221; ../shared/reference/mammothmoda2-dev.md).
MEMBERS: dict[str, tuple[str, bool]] = {
    "preview": ("mammothmoda2_qwen2_5_vl", False),
    "dev": ("mammothmoda2_qwen3_vl", True),
}
#: The parts of ``config.json`` that decide what a condition is: the AR that writes the hidden states (its whole
#: ``llm_config``), which positions become the condition, and how the DiT reads it (its input projection's width and
#: the optional refiner). Two checkpoints that differ here cannot exchange conditions.
CONDITION_CONFIG_KEYS = ("llm_config", "gen_condition_mode", "gen_image_condition_refiner_config")
CONDITION_DIT_KEYS = ("text_feat_dim",)


@dataclass(frozen=True)
class ModelIdentity:
    """Which model a condition belongs to: the checkpoint directory's name and a fingerprint of the
    condition-defining config (``condition_fingerprint``). The AR sends its own with every Render; the DiT refuses a
    condition whose identity is not its own (dit_service/planning.py)."""

    name: str
    fingerprint: str

    def __str__(self) -> str:
        return f"'{self.name}' (condition config {self.fingerprint})"


def condition_fingerprint(config: dict[str, Any]) -> str:
    """The first 12 hex digits of the SHA-256 of the condition-defining config, as canonical JSON."""
    dit = config.get("gen_dit_config") or {}
    part = {key: config.get(key) for key in CONDITION_CONFIG_KEYS}
    part["gen_dit_config"] = {key: dit.get(key) for key in CONDITION_DIT_KEYS}
    text = json.dumps(part, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


#: The negative prompt the released MammothModa2 README passes with every request (bytedance/mammothmoda qwen25vl
#: ``mammothmoda2/model/processing_mammothmoda2.py`` lines 36-40, ``DEFAULT_NEGATIVE_PROMPT``; README line 94).
RELEASED_NEGATIVE_PROMPT = (
    "deformed, blurry, over saturation, bad anatomy, disfigured, poorly drawn face, mutation, mutated, "
    "extra_limb, ugly, poorly drawn hands, fused fingers, messy drawing, broken legs censor, censored, "
    "censor_bar Create an image from the instruction."
)
#: Accepted values of the behaviour settings below; the first of each is the default.
SETTING_CHOICES = {
    "grid_rule": ("token_budget", "pixels_per_token"),
    "condition_scope": ("all_generated", "answer_window", "prompt_tail"),
    "visual_token_scope": ("exclusive_end", "start_plus_end"),
    "cfg_range_policy": ("per_step", "off_after_first_exit"),
}


#: The largest enlargement factor a checkpoint may allow (ServingDefaults.max_upscale); dit_service refuses more.
MAX_UPSCALE = 16


@dataclass(frozen=True)
class ServingDefaults:
    """What ardit needs to serve a checkpoint that the checkpoint itself does not say (``ardit_serving.json``).

    grid_rule: how the AR's visual-token grid follows the rendered size (ar_service.prompt.GridRule owns the
    formula). ``token_budget`` (default): about ``grid_tokens`` visual tokens at the image's aspect ratio, whatever
    its size; with the default 1024 every square size gets the 32x32 grid the released MammothModa2 code decodes
    (bytedance/mammothmoda qwen25vl: the processor's and ``generate_t2i``'s ar_height = ar_width = 32, the README's
    1024x1024 example). ``pixels_per_token``: one token per ``pixels_per_token`` x ``pixels_per_token`` pixels
    (vllm-omni's MammothModa2 stage with 16: 1024x1024 -> a 64x64 grid, four times the released AR work); sizes
    must then be multiples of pixels_per_token too.
    grid_tokens: the token_budget rule's budget (width x height of the grid, about).
    pixels_per_token: the pixels_per_token rule's pixels per token along each side.

    The rest choose between the released MammothModa2 inference code and ardit's defaults where they differ
    (docs/models/mammothmoda2.md, "Where ardit and the references differ"):

    - default_negative_prompt: the DiT's unconditional branch when a request gives no ``negative_prompt``; the
      released README's text by default; "" makes it the empty condition (vllm-omni).
    - condition_scope: which generated rows become the DiT's image condition. ``all_generated`` (default for the
      mammothmoda2 family: vllm-omni and the later Dev release keep every row, and Preview's 128-query Q-Former
      refiner exists to compress a long condition); ``answer_window``: the released Preview code's ~10 rows;
      ``prompt_tail`` (the Dev member's default): the released Dev code, split 10 positions before the prompt's end,
      every generation id from there on (the header's ``<|image start|>`` and ``<|image token|>``, the grid,
      ``<|image end|>``) is the image condition and only the question before the split is text condition.
    - visual_token_scope: ``exclusive_end`` samples visual ids in [start, end) (vllm-omni; the unmerged upstream fix);
      ``start_plus_end``: the released code's [start, start + end), i.e. up to the end of the vocabulary.
    - cfg_range_policy: ``per_step`` decides DiT guidance at each step (vllm-omni; the unmerged upstream fix);
      ``off_after_first_exit``: the released code, where the first step outside cfg_range turns guidance off for
      good (a range that starts above 0 never guides).

    max_upscale: the largest whole factor a picture may be enlarged by after decoding, so that a size above
    max_side can still be answered (1, the default: never). A request for W x H above max_side is rendered at
    W/f x H/f for the smallest factor f <= max_upscale that brings both sides within the default size's long side
    (the size the model draws best; whole multiples of the size multiple), then enlarged f times
    (ar_service.prompt.upscale_for); the answer states W x H and its pictures are W x H. For a small model trained
    at one size (train/: 128x128) this is how OpenAI clients' fixed 512x512 and 1024x1024 requests get an honest
    answer: the model's own 128x128 drawing, enlarged 4 or 8 times, never a size other than the one stated.

    knob_defaults: per-request knobs (AR or DiT stage) this checkpoint is best served with when a request leaves
    them out, over the family's defaults: e.g. a small model trained for guidance 3, not MammothModa2's 9. The
    services check names and values against the family's knob table at start-up.
    """

    default_width: int = 1024
    default_height: int = 1024
    max_side: int = 2048
    grid_rule: str = SETTING_CHOICES["grid_rule"][0]
    grid_tokens: int = 1024
    pixels_per_token: int = 16
    default_negative_prompt: str = RELEASED_NEGATIVE_PROMPT
    condition_scope: str = SETTING_CHOICES["condition_scope"][0]
    visual_token_scope: str = SETTING_CHOICES["visual_token_scope"][0]
    cfg_range_policy: str = SETTING_CHOICES["cfg_range_policy"][0]
    knob_defaults: dict[str, Any] = field(default_factory=dict)
    max_upscale: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.max_upscale <= MAX_UPSCALE:
            raise ValueError(f"max_upscale must be between 1 and {MAX_UPSCALE}; got {self.max_upscale}")
        for name, choices in SETTING_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.grid_tokens < 1:
            raise ValueError(f"grid_tokens must be at least 1; got {self.grid_tokens}")
        if self.pixels_per_token < 1:
            raise ValueError(f"pixels_per_token must be at least 1; got {self.pixels_per_token}")


#: What a member serves with where ``ardit_serving.json`` does not say, over ``ServingDefaults``' own defaults (Preview's).
#: Dev: the released code's 16x16 grid (``generate_t2i``'s ar_height = ar_width = 16, main
#: ``mamoda2/mammothmoda2/model/modeling_mammothmoda2.py`` 286-287) and its condition split (``prompt_tail``,
#: ``mamoda2/mammothmoda2/utils/t2i_utils.py`` 310-314).
MEMBER_SERVING_DEFAULTS: dict[str, dict[str, Any]] = {
    "preview": {},
    "dev": {"grid_tokens": 256, "condition_scope": "prompt_tail"},
}


def member_of(config: dict[str, Any]) -> str:
    """Which released member a root ``config.json`` describes (``MEMBERS``), from the fields that tell them apart; a
    layout of neither (an unknown AR, or one member's AR beside the other's DiT) is refused naming those fields."""
    llm, dit = config.get("llm_config"), config.get("gen_dit_config")
    llm = llm if isinstance(llm, dict) else {}
    dit = dit if isinstance(dit, dict) else {}
    llm_type, embedder = llm.get("model_type"), bool(dit.get("is_image_embedder", False))
    for member, (member_llm, member_embedder) in MEMBERS.items():
        if llm_type == member_llm and embedder == member_embedder:
            return member
    known = "; ".join(f"{m}: llm_config.model_type {t!r} with gen_dit_config.is_image_embedder {str(e).lower()}"
                      for m, (t, e) in MEMBERS.items())
    raise ValueError(f"config.json has llm_config.model_type {llm_type!r} and gen_dit_config.is_image_embedder "
                     f"{str(embedder).lower()}: a layout of no known mammothmoda2 member ({known})")


@dataclass(frozen=True)
class PipelineCheckpoint:
    root: Path
    config: dict[str, Any]
    serving: ServingDefaults
    weight_map: dict[str, str]  # tensor name -> file name within root

    @property
    def family(self) -> str:
        return self.config["model_type"]

    @property
    def member(self) -> str:
        """The released member of the family (``MEMBERS``): "preview" or "dev"."""
        return member_of(self.config)

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.name, condition_fingerprint(self.config))

    @property
    def size_multiple(self) -> int:
        """Pixel sizes must be multiples of this for the DiT: VAE downsampling x patch size."""
        vae = self.config["gen_vae_config"]
        downsampling = 2 ** (len(vae.get("block_out_channels", (0, 0, 0, 0))) - 1)
        return downsampling * int(self.config["gen_dit_config"].get("patch_size", 2))

    def tensor_names(self, prefix: str = "") -> list[str]:
        return sorted(name for name in self.weight_map if name.startswith(prefix))

    def load_tensors(
        self, prefix: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Every tensor under ``prefix``, with the prefix stripped, read from the files that hold them."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in self.tensor_names(prefix):
            by_file.setdefault(self.weight_map[name], []).append(name)
        tensors = {}
        for file_name, names in sorted(by_file.items()):
            with safe_open(str(self.root / file_name), framework="pt", device=str(device)) as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    tensors[name[len(prefix):]] = tensor
        return tensors


def open_checkpoint(root: Path | str, require_weights: bool = True) -> PipelineCheckpoint:
    """Reads a pipeline directory's config and weight map; anything missing is a clear error.

    ``require_weights=False`` accepts a directory without safetensors (empty weight map): the random-weight
    benchmark mode needs only config.json, the tokenizer and the t2i config.
    """
    root = Path(root).resolve()
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {root}: point --model-dir at a MammothModa2 checkpoint directory "
            "(make a tiny one with `python -m tools.make_tiny DIR`)"
        )
    config = json.loads(config_path.read_text())
    if config.get("model_type") not in FAMILIES:
        raise ValueError(f"{config_path}: model_type {config.get('model_type')!r} is not served; known: {', '.join(FAMILIES)}")
    try:
        member = member_of(config)
    except ValueError as exc:
        raise ValueError(f"{config_path}: {exc}") from None
    has_weights = (root / WEIGHTS_INDEX).is_file() or (root / SINGLE_WEIGHTS).is_file()
    weight_map = _weight_map(root) if require_weights or has_weights else {}
    serving = _read_serving(root, MEMBER_SERVING_DEFAULTS[member])
    return PipelineCheckpoint(root=root, config=config, serving=serving, weight_map=weight_map)


def _read_serving(root: Path, member_defaults: dict[str, Any] | None = None) -> ServingDefaults:
    """``ardit_serving.json`` over the member's defaults over ``ServingDefaults``'."""
    member_defaults = member_defaults or {}
    path = root / SERVING_FILE
    if not path.is_file():
        return ServingDefaults(**member_defaults)
    data = json.loads(path.read_text())
    known = {f.name for f in fields(ServingDefaults)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    kinds = {f.name: type(getattr(ServingDefaults(), f.name)) for f in fields(ServingDefaults)}
    wrong = [key for key, value in data.items() if not isinstance(value, kinds[key]) or isinstance(value, bool)]
    if wrong:
        names = {int: "an integer", str: "a string", dict: "an object"}
        raise ValueError(f"{path}: {', '.join(f'{k} must be {names[kinds[k]]}' for k in sorted(wrong))}")
    try:
        return ServingDefaults(**{**member_defaults, **data})
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _weight_map(root: Path) -> dict[str, str]:
    index = root / WEIGHTS_INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = root / SINGLE_WEIGHTS
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return {name: SINGLE_WEIGHTS for name in handle.keys()}
    raise FileNotFoundError(f"{root} holds neither {SINGLE_WEIGHTS} nor {WEIGHTS_INDEX}")


def write_serving_defaults(root: Path, serving: ServingDefaults) -> None:
    (Path(root) / SERVING_FILE).write_text(json.dumps(asdict(serving), indent=2, sort_keys=True) + "\n")


def save_tensors(root: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 5 * 1024**3) -> None:
    """Writes weights deterministically: one file, or shards plus an index past ``max_shard_bytes``."""
    from safetensors.torch import save_file

    root = Path(root)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(root / SINGLE_WEIGHTS), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / file_name), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file_name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
