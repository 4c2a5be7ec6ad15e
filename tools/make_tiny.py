"""Writes the tiny MammothModa2-family pipeline that tests, CI and `make up` run on the CPU.

Usage: ``python -m tools.make_tiny DIR``. Deterministic: the same command writes the same
bytes. The directory is written beside DIR and renamed into place, so an interrupted run
never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from transformers.utils import logging as transformers_logging

from ar_service.model.tiny import TINY_HIDDEN_SIZE, write_tiny_ar
from dit_service.model.pipeline import DiTPipeline
from dit_service.model.tiny import write_tiny_dit_stack
from servicekit.model_index import write_model_index

# 256x256 keeps a CPU request around a second; 512 caps it at a few seconds.
TINY_DEFAULT_SIZE = (256, 256)
TINY_MAX_SIDE = 512


def make_tiny(target: Path) -> None:
    transformers_logging.disable_progress_bar()
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        write_tiny_ar(staging / "ar")
        write_tiny_dit_stack(staging, condition_dim=TINY_HIDDEN_SIZE)
        # The DiT stack decides its own size granularity (VAE downsampling x patch size).
        size_multiple = DiTPipeline.from_directory(staging).size_multiple
        write_model_index(staging, "mammothmoda2", TINY_DEFAULT_SIZE, TINY_MAX_SIDE, size_multiple)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.make_tiny", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the pipeline (replaced if present)")
    args = parser.parse_args(argv)
    make_tiny(args.directory)
    print(f"tiny pipeline written to {args.directory}")


if __name__ == "__main__":
    main()
