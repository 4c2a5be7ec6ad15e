"""TLS and mutual TLS for ardit's gRPC hops (gateway -> ar_service, ar_service -> dit_service).

Everything is configured by paths to PEM files in each service's settings:

- a server: ``cert`` + ``key`` turn TLS on; a ``client_ca`` additionally requires every client to
  present a certificate signed by that CA (mutual TLS);
- a client: ``ca`` (the CA that signed the server's certificate) turns TLS on; ``cert`` + ``key``
  present a client certificate (for a server that requires one); ``server_name`` overrides the name
  checked against the server's certificate (when the address is not a name the certificate holds).

No file given: plaintext, as before. A half-configured pair (cert without key) is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


class TLSConfigError(ValueError):
    """A TLS setting that cannot work (missing file, cert without key, ...)."""


def _read(path: Path | str | None, what: str) -> bytes | None:
    if path is None or str(path) == "":
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ServerTLS:
    cert_file: Path | None = None
    key_file: Path | None = None
    client_ca_file: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None or self.key_file is not None or self.client_ca_file is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.enabled:
            return None
        if self.cert_file is None or self.key_file is None:
            raise TLSConfigError("server TLS needs both a certificate file and a key file")
        cert = _read(self.cert_file, "TLS certificate")
        key = _read(self.key_file, "TLS key")
        client_ca = _read(self.client_ca_file, "client CA file")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


@dataclass(frozen=True)
class ClientTLS:
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None

    @property
    def enabled(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None or self.key_file is not None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.enabled:
            return None
        if (self.cert_file is None) != (self.key_file is None):
            raise TLSConfigError("a client certificate needs both a certificate file and a key file")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA file"),
            private_key=_read(self.key_file, "TLS key"),
            certificate_chain=_read(self.cert_file, "TLS certificate"),
        )

    def options(self) -> list[tuple[str, Any]]:
        if self.enabled and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def add_port(server: grpc.Server, address: str, tls: ServerTLS | None) -> int:
    """Binds ``address`` with TLS when configured; returns the port (0 when binding failed)."""
    credentials = tls.credentials() if tls is not None else None
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:
        return 0


def open_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking-API channel, TLS when ``tls`` is enabled."""
    credentials = tls.credentials() if tls is not None else None
    options = [*options, *(tls.options() if tls is not None else [])]
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def open_aio_channel(
    address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] | None = None
) -> grpc.aio.Channel:
    """An asyncio channel, TLS when ``tls`` is enabled, with ``interceptors`` (e.g. tracing's) when given."""
    credentials = tls.credentials() if tls is not None else None
    options = [*options, *(tls.options() if tls is not None else [])]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
