"""ar_service settings (env prefix ARDIT_AR_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from servicekit.settings import ServiceSettings


class ARSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_AR_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = any free port)")
    model_dir: Path = Field(Path("models/tiny"), description="pipeline directory holding model_index.json")
    model_id: str | None = Field(None, description="served model name (default: the model directory's name)")
    dit_address: str = Field("127.0.0.1:50052", description="dit_service's host:port")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto (CUDA when present)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="model dtype (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    max_prompt_tokens: int = Field(1024, ge=1, description="longest prompt accepted, in tokens")
    max_workers: int = Field(32, ge=2, description="gRPC handler threads")
    log_level: str = Field("info", description="debug, info, warning or error")
