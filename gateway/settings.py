"""Gateway settings (env prefix ARDIT_GATEWAY_): defaults < YAML < environment < explicit flag."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from servicekit.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_GATEWAY_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    ar_address: str = Field("127.0.0.1:50051", description="ar_service's host:port (ImageGenerator)")
    dit_address: str = Field("127.0.0.1:50052", description="dit_service's host:port (health checks only)")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of one image request's gRPC call, in seconds")
    max_body_bytes: int = Field(1_048_576, ge=1, description="largest request body accepted, in bytes (larger: 413)")
    log_level: str = Field("info", description="debug, info, warning or error")
