"""Service settings: defaults < YAML file < environment < explicit command-line flag.

Each service declares one pydantic-settings class. ``load_settings`` builds its command line
from the fields (so ``--help`` lists every setting with its default and environment variable),
and passes only the flags the user actually typed as init values: an explicit flag therefore
wins even when it equals the default. The YAML file comes from ``--config`` or the
``<PREFIX>CONFIG`` environment variable; unknown keys in it are an error.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, Field
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from protos.channels import DEFAULT_MAX_CONNECTION_AGE_GRACE_S, DEFAULT_MAX_CONNECTION_AGE_S, check_target

_yaml_values: ContextVar[dict[str, Any] | None] = ContextVar("ardit_yaml_settings", default=None)

S = TypeVar("S", bound="ServiceSettings")

#: Where a service finds the next stage: any gRPC target (host:port, dns:///name:port, ipv4:a:port,b:port).
GrpcTarget = Annotated[str, AfterValidator(check_target)]
#: Longest connection age accepted, in seconds (gRPC takes milliseconds in a 32-bit int).
_MAX_AGE_S = 2_000_000.0


class ServiceSettings(BaseSettings):
    """Base of every service's settings; subclasses set ``env_prefix``."""

    model_config = SettingsConfigDict(extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=_yaml_values.get() or {})


class ModelServiceSettings(ServiceSettings):
    """Settings both model services have (the ones that run an engine on a device)."""

    profile_dir: Path | None = Field(
        None,
        description="write a torch.profiler Chrome trace of each busy period (idle -> busy -> idle) to this directory, "
        "named <service>-<UTC time>-<first request id>.json, at most profile_max_traces per process "
        "(default: off, at no cost)",
    )
    profile_max_traces: int = Field(
        10, ge=1, description="most traces profile_dir gets per process; later busy periods are not traced (bounds disk use)"
    )
    max_connection_age_s: float = Field(
        DEFAULT_MAX_CONNECTION_AGE_S, ge=0, le=_MAX_AGE_S,
        description="close each client connection after this long (0 = never), so that clients resolve the "
        "service's name again and spread over replicas that came or went",
    )
    max_connection_age_grace_s: float = Field(
        DEFAULT_MAX_CONNECTION_AGE_GRACE_S, ge=0, le=_MAX_AGE_S,
        description="calls still running on a connection past max_connection_age_s get this long to finish",
    )
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="fp8: hold the model's large linear layers in e4m3 with per-output-channel scales, quantized at "
        "load from the bf16 checkpoint (the AR: weight-only, in its decode kernels; the DiT: fp8 matmuls with per-token "
        "activation scales); needs a CUDA GPU of compute capability 8.9 or later (start-up refuses it elsewhere)",
    )


def _flag_type(annotation: Any) -> Any:
    """The argparse type for a field annotation (Optional[X] -> X)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else str
    if typing.get_origin(annotation) is typing.Literal:
        return str
    return annotation if annotation in (int, float, str, Path, bool) else str


def build_parser(cls: type[ServiceSettings], prog: str, description: str) -> argparse.ArgumentParser:
    prefix = cls.model_config.get("env_prefix", "")
    parser = argparse.ArgumentParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
    parser.add_argument(
        "--config", type=Path, metavar="YAML", help=f"YAML file with settings (env {prefix}CONFIG); flags and env win over it"
    )
    for name, info in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(info.annotation)
        help_text = f"{info.description or ''} (default: {info.default!r}; env {prefix}{name.upper()})".strip()
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            choices = None
            if typing.get_origin(info.annotation) is typing.Literal:
                choices = typing.get_args(info.annotation)
            parser.add_argument(flag, dest=name, type=kind, choices=choices, help=help_text)
    return parser


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise SystemExit(f"settings file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise SystemExit(f"settings file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise SystemExit(f"settings file {path} must hold a mapping of setting names to values")
    return {str(key).replace("-", "_"): value for key, value in loaded.items()}


def load_settings(cls: type[S], argv: list[str] | None = None, prog: str = "", description: str = "") -> S:
    """Parses flags, environment and the YAML file into a settings object."""
    parser = build_parser(cls, prog or cls.__name__, description)
    explicit = vars(parser.parse_args(argv))
    prefix = cls.model_config.get("env_prefix", "")
    yaml_path = explicit.pop("config", None) or os.environ.get(f"{prefix}CONFIG")
    token = _yaml_values.set(read_yaml(yaml_path) if yaml_path else {})
    try:
        return cls(**explicit)
    finally:
        _yaml_values.reset(token)
