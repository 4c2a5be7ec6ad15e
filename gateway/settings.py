"""Gateway settings (env prefix ARDIT_GATEWAY_): defaults < YAML < environment < explicit flag."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from servicekit.settings import GrpcTarget, ServiceSettings

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")


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
    sse_keepalive_s: float = Field(
        10.0, gt=0, description="with stream: a keep-alive comment after this many seconds without another event"
    )
    max_body_bytes: int = Field(1_048_576, ge=1, description="largest request body accepted, in bytes (larger: 413); "
                                "/v1/images/edits takes edit_max_total_bytes and 1 MiB more")
    edit_max_image_bytes: int = Field(
        33_554_432, ge=1, description="largest input image file of an edit, in bytes (larger: 400); dit_service's bound "
        "on one reference, 32 MiB (OpenAI takes files under 50 MB)"
    )
    edit_max_total_bytes: int = Field(
        67_108_864, ge=1, description="largest sum of an edit's input image files, in bytes (larger: 400)"
    )
    edit_max_image_pixels: int = Field(
        40_000_000, ge=1, description="largest width * height of an edit's input image (larger: 400, a decompression bomb)"
    )
    log_level: str = Field("info", description="debug, info, warning or error")
    model_aliases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="other model names requests may use, each for one served model: 'ALIAS=MODEL,ALIAS=MODEL' (or a "
        "JSON object / YAML mapping), e.g. 'dall-e-2=shapes' for clients that send OpenAI's model names unasked; "
        "/v1/models lists each alias as such, and any other name is still 404",
    )
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
    # -- images answered by URL (response_format "url"; gateway/stored_images.py) --
    base_url: str | None = Field(
        None,
        description="the gateway's public URL as clients reach it (e.g. https://images.example.com behind a proxy); "
        "image URLs start with it (default: derived from each request's Host)",
    )
    image_store_dir: Path | None = Field(
        None, description="keep URL images in this directory (shareable between gateways) instead of in memory"
    )
    image_store_max_images: int = Field(1000, ge=1, description="most images kept for URLs; the oldest go first")
    image_store_max_bytes: int = Field(
        268_435_456, ge=1, description="most bytes of images kept for URLs (default 256 MiB); the oldest go first"
    )
    image_url_ttl_s: float = Field(3600.0, gt=0, description="how long an image URL answers, in seconds (OpenAI: 60 minutes)")

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _parse_aliases(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("{"):
            return json.loads(text)
        aliases: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            alias, sep, model = (side.strip() for side in item.partition("="))
            if not sep or not alias or not model:
                raise ValueError(f"model_aliases entries are ALIAS=MODEL separated by commas; got {item!r}")
            if alias in aliases:
                raise ValueError(f"model_aliases names {alias!r} twice")
            aliases[alias] = model
        return aliases

    @field_validator("model_aliases")
    @classmethod
    def _aliases_are_names(cls, aliases: dict[str, str]) -> dict[str, str]:
        for alias, model in aliases.items():
            if not _MODEL_NAME.match(alias) or not _MODEL_NAME.match(model):
                raise ValueError(f"model_aliases: {alias!r}={model!r} is not a pair of model names (letters, digits, ._:/-)")
            if alias == model:
                raise ValueError(f"model_aliases: {alias!r} is an alias of itself")
            if model in aliases:
                raise ValueError(f"model_aliases: {alias!r} points at {model!r}, which is itself an alias")
        return aliases

    @field_validator("base_url")
    @classmethod
    def _base_url_is_http(cls, value: str | None) -> str | None:
        if not value:
            return None  # unset, or set empty (e.g. an unset variable in compose.yaml)
        if not value.startswith(("http://", "https://")) or "?" in value or "#" in value:
            raise ValueError(f"base_url must be an http:// or https:// URL without query or fragment; got {value!r}")
        return value.rstrip("/")
