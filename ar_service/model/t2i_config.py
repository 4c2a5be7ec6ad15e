"""`t2i_generation_config.json`: the AR's sampling defaults and the only source of EOL/visual token ids.

Field names follow MammothModa2's file of the same name (bytedance/mammothmoda; REFERENCE.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

T2I_CONFIG_NAME = "t2i_generation_config.json"


@dataclass(frozen=True)
class T2IGenerationConfig:
    temperature: float
    top_k: int
    top_p: float
    eol_token_id: int
    visual_token_start_id: int
    visual_token_end_id: int  # inclusive

    def __post_init__(self) -> None:
        if self.visual_token_start_id > self.visual_token_end_id:
            raise ValueError("visual_token_start_id must not exceed visual_token_end_id")
        if self.visual_token_start_id <= self.eol_token_id <= self.visual_token_end_id:
            raise ValueError("eol_token_id must lie outside the visual token range")

    @classmethod
    def load(cls, directory: str | Path) -> T2IGenerationConfig:
        path = Path(directory) / T2I_CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"missing {path}")
        data = json.loads(path.read_text())
        names = {f.name for f in fields(cls)}
        missing = names - data.keys()
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)}")
        return cls(**{k: data[k] for k in names})

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / T2I_CONFIG_NAME
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
