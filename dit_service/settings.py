"""dit_service settings (env prefix ARDIT_DIT_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from servicekit.settings import ServiceSettings


class DiTSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_DIT_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 = any free port)")
    model_dir: Path = Field(Path("models/tiny"), description="pipeline directory holding model_index.json")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto (CUDA when present)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="model dtype (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    max_condition_positions: int = Field(
        65_536, ge=1, description="most condition positions one Render may declare (bounds its memory)"
    )
    max_workers: int = Field(32, ge=2, description="gRPC handler threads")
    log_level: str = Field("info", description="debug, info, warning or error")
