"""Writes MammothModa2-layout pipeline directories: the tiny model, or a Preview-shaped skeleton.

``python -m tools.make_tiny DIR`` writes the tiny model that tests, CI and `make up` run on the
CPU: a complete upstream-layout checkpoint (config.json, t2i_generation_config.json, tokenizer,
model.safetensors with llm_model. / gen_transformer. / gen_vae. tensors) of a few MB, byte for byte
the same on every run; ``--dev`` the same at the MammothModa2-Dev layout (Qwen3-VL AR, Q-Former inside the DiT).
``--preview`` and ``--dev-skeleton`` write a Preview- or Dev-shaped directory without weights (configs and
tokenizer only) for services started with ``--random-weights``, which build the weights on the GPU.

The directory is written beside DIR and renamed into place, so an interrupted run never leaves a
half-written model behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from transformers.utils import logging as transformers_logging

from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.model.tiny import (
    TINY_DEV_CONDITION_LAYERS,
    TINY_GEN_TOKENIZER_CONFIG,
    TINY_GRID,
    TINY_HIDDEN_SIZE,
    dev_llm_config,
    preview_llm_config,
    root_config,
    tiny_dev_llm_parts,
    tiny_llm_parts,
    write_preview_tokenizer_and_t2i,
    write_tiny_tokenizer_and_t2i,
)
from dit_service.model.pipeline import dev_gen_parts, preview_gen_parts
from dit_service.model.tiny import tiny_dev_gen_parts, tiny_gen_parts
from servicekit.checkpoint import CONFIG_FILE, ServingDefaults, save_tensors, write_serving_defaults

# 256x256 keeps a CPU request around a second; 512 caps it at a few seconds. Its grid: one token per 16x16 pixels
# (TINY_GRID); the Preview-shaped skeleton gets the released grid (ServingDefaults: about 1,024 tokens, 32x32 square).
TINY_SERVING = ServingDefaults(default_width=256, default_height=256, max_side=512, **TINY_GRID)
#: The tiny Dev model: the tiny model's sizes and grid, and the Dev member's released condition split.
TINY_DEV_SERVING = replace(TINY_SERVING, condition_scope="prompt_tail")
PREVIEW_HIDDEN_SIZE = 3584
DEV_HIDDEN_SIZE = 4096


def _write_config(root: Path, llm_config: dict, gen_parts: dict) -> None:
    (root / CONFIG_FILE).write_text(json.dumps(root_config(llm_config, gen_parts), indent=2, sort_keys=True) + "\n")


def write_pipeline(
    root: Path,
    llm_config: dict,
    gen_parts: dict,
    tensors: dict,
    serving: ServingDefaults,
    t2i: T2IGenerationConfig | None = None,
) -> None:
    """The one save path of a tiny-vocabulary pipeline (random here, trained by train/): config.json, weights,
    the tiny tokenizer, t2i_generation_config.json and ardit_serving.json."""
    _write_config(root, llm_config, gen_parts)
    save_tensors(root, tensors)
    write_tiny_tokenizer_and_t2i(root, t2i)
    write_serving_defaults(root, serving)


def write_tiny(root: Path) -> None:
    llm_config, ar_tensors = tiny_llm_parts()
    gen_parts, gen_tensors = tiny_gen_parts(TINY_HIDDEN_SIZE)
    write_pipeline(root, llm_config, gen_parts, {**ar_tensors, **gen_tensors}, TINY_SERVING)


def write_tiny_dev(root: Path) -> None:
    """The tiny model at the Dev layout; its 4 layers take a short ``gen_condition_layers`` (the released default
    reaches 17 layers back)."""
    llm_config, ar_tensors = tiny_dev_llm_parts()
    gen_parts, gen_tensors = tiny_dev_gen_parts(TINY_HIDDEN_SIZE)
    gen_parts = {**gen_parts, "gen_condition_layers": list(TINY_DEV_CONDITION_LAYERS),
                 "gen_tokenizer_config": TINY_GEN_TOKENIZER_CONFIG}
    write_pipeline(root, llm_config, gen_parts, {**ar_tensors, **gen_tensors}, TINY_DEV_SERVING)


def write_preview_skeleton(root: Path) -> None:
    _write_config(root, preview_llm_config(), preview_gen_parts(PREVIEW_HIDDEN_SIZE))
    write_preview_tokenizer_and_t2i(root)
    write_serving_defaults(root, ServingDefaults())


def write_dev_skeleton(root: Path) -> None:
    """Dev's shapes with no weights and no ``ardit_serving.json`` (the Dev member's defaults: the released 16x16
    grid and condition split). Dev's ids from 152064 up are Preview's (../shared/reference: the tokenizer's
    margins end where Preview's do), so it takes Preview's tokenizer and t2i config."""
    _write_config(root, dev_llm_config(), dev_gen_parts(DEV_HIDDEN_SIZE))
    write_preview_tokenizer_and_t2i(root)


def write_atomically(target: Path, writer) -> None:
    """Runs ``writer(staging_dir)`` beside ``target``, then renames the result into place."""
    transformers_logging.disable_progress_bar()
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        writer(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def make_tiny(target: Path) -> None:
    write_atomically(target, write_tiny)


def make_preview_skeleton(target: Path) -> None:
    write_atomically(target, write_preview_skeleton)


def make_tiny_dev(target: Path) -> None:
    write_atomically(target, write_tiny_dev)


def make_dev_skeleton(target: Path) -> None:
    write_atomically(target, write_dev_skeleton)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.make_tiny", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the pipeline (replaced if present)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--dev", action="store_true", help="the tiny model at the MammothModa2-Dev layout")
    kind.add_argument(
        "--preview", action="store_true", help="write a Preview-shaped directory without weights (for --random-weights)"
    )
    kind.add_argument(
        "--dev-skeleton", action="store_true", help="write a Dev-shaped directory without weights (for --random-weights)"
    )
    args = parser.parse_args(argv)
    if args.preview:
        make_preview_skeleton(args.directory)
        print(f"Preview-shaped skeleton (no weights) written to {args.directory}")
    elif args.dev_skeleton:
        make_dev_skeleton(args.directory)
        print(f"Dev-shaped skeleton (no weights) written to {args.directory}")
    elif args.dev:
        make_tiny_dev(args.directory)
        print(f"tiny Dev pipeline written to {args.directory}")
    else:
        make_tiny(args.directory)
        print(f"tiny pipeline written to {args.directory}")


if __name__ == "__main__":
    main()
