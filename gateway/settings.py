"""Gateway settings (env prefix ARDIT_GATEWAY_): defaults < YAML < environment < explicit flag."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from servicekit.settings import GrpcTarget, ServiceSettings


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_GATEWAY_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    ar_address: GrpcTarget = Field(
        "127.0.0.1:50051",
        description="ar_service's gRPC target: host:port, dns:///name:port or ipv4:host:port,host:port (replicas: "
        "each request goes to the next one serving)",
    )
    dit_address: GrpcTarget = Field(
        "127.0.0.1:50052", description="dit_service's gRPC target, as ar_address (health checks only)"
    )
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of one image request's gRPC call, in seconds")
    max_body_bytes: int = Field(1_048_576, ge=1, description="largest request body accepted, in bytes (larger: 413)")
    log_level: str = Field("info", description="debug, info, warning or error")
    # -- API keys: none configured = open; any configured = every route but /health and the docs needs one --
    api_keys: SecretStr | None = Field(
        None, description="comma-separated API keys clients send as 'Authorization: Bearer KEY' (prefer the env variable)"
    )
    api_keys_file: Path | None = Field(None, description="file of API keys, one per line (# comments and blank lines skipped)")
    # -- TLS to ar_service and dit_service (servicekit/tls.py) --
    grpc_tls_ca_file: Path | None = Field(None, description="PEM CA that signed the services' certificates: talk TLS to them")
    grpc_tls_cert_file: Path | None = Field(None, description="PEM client certificate presented to the services (mutual TLS)")
    grpc_tls_key_file: Path | None = Field(None, description="PEM private key of grpc_tls_cert_file")
    grpc_tls_server_name: str | None = Field(None, description="name to verify the services' certificates against")
