"""The pipeline directory's ``model_index.json``: which model family, where each component
lives, and the serving limits that belong to the model rather than to a deployment."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = "model_index.json"


@dataclass(frozen=True)
class ModelIndex:
    root: Path
    family: str
    ar: Path
    dit: Path
    vae: Path
    scheduler: Path
    default_width: int
    default_height: int
    max_side: int
    size_multiple: int  # the DiT's own (VAE downsampling x patch size); the AR adds its pixels per token

    @property
    def name(self) -> str:
        return self.root.name


def read_model_index(root: Path | str) -> ModelIndex:
    """Reads ``root/model_index.json``; a missing or malformed file is a clear error."""
    root = Path(root).resolve()
    path = root / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {INDEX_FILE} in {root}: point --model-dir at a pipeline directory "
            "(make one with `python -m tools.make_tiny DIR`)"
        )
    try:
        data = json.loads(path.read_text())
        components = data["components"]
        return ModelIndex(
            root=root,
            family=data["family"],
            ar=root / components["ar"],
            dit=root / components["dit"],
            vae=root / components["vae"],
            scheduler=root / components["scheduler"],
            default_width=int(data["default_size"][0]),
            default_height=int(data["default_size"][1]),
            max_side=int(data["max_side"]),
            size_multiple=int(data["size_multiple"]),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{path} is malformed: {exc!r}") from exc


def write_model_index(
    root: Path, family: str, default_size: tuple[int, int], max_side: int, size_multiple: int
) -> None:
    components = {"ar": "ar", "dit": "dit", "vae": "vae", "scheduler": "scheduler"}
    data = {
        "family": family,
        "components": components,
        "default_size": list(default_size),
        "max_side": max_side,
        "size_multiple": size_multiple,
    }
    (root / INDEX_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
