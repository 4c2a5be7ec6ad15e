"""Optional API keys: ``Authorization: Bearer <key>`` on every route but the open ones.

Keys come from ``api_keys`` (comma-separated; best set through ``ARDIT_GATEWAY_API_KEYS``) and/or
``api_keys_file`` (one key per line; blank lines and ``#`` comments skipped). None configured: the
gateway is open, as before. Keys are compared with ``hmac.compare_digest`` against every configured
key (no early exit), and never logged. ``/health`` stays open for load balancers and probes; the
OpenAPI document and its viewers stay open too (they describe the API, they do not use it), and so do the
playground page and the stored images' unguessable URLs.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_response
from gateway.settings import GatewaySettings
from gateway.stored_images import ROUTE_PREFIX as STORED_IMAGES_PREFIX

# "/" is the playground page (it holds no secret; it asks for a key when the API wants one).
OPEN_PATHS = frozenset({"/", "/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
# Stored images: the unguessable URL is the capability, as OpenAI's signed image URLs are (an <img> sends no key).
OPEN_PREFIXES = (STORED_IMAGES_PREFIX,)


def load_api_keys(settings: GatewaySettings) -> tuple[bytes, ...]:
    """Every configured key; an ``api_keys_file`` that holds none is an error (it would open the gateway)."""
    keys: list[str] = []
    if settings.api_keys is not None:
        keys += [key.strip() for key in settings.api_keys.get_secret_value().split(",") if key.strip()]
    if settings.api_keys_file is not None:
        try:
            lines = Path(settings.api_keys_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read api_keys_file {settings.api_keys_file}: {exc.strerror or exc}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not from_file:
            raise ValueError(f"api_keys_file {settings.api_keys_file} holds no keys")
        keys += from_file
    if settings.api_keys is not None and not keys:
        raise ValueError("api_keys is set but holds no keys")
    return tuple(dict.fromkeys(key.encode("utf-8") for key in keys))


def key_is_valid(given: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant time in the key's content: every configured key is compared, whatever matched."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    return matched


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            return token.strip()
    return None


class APIKeyMiddleware:
    """Answers 401 in OpenAI's shape unless the request carries a configured key."""

    def __init__(self, app: ASGIApp, keys: tuple[bytes, ...]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.keys or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token and key_is_valid(token, self.keys):
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key: send 'Authorization: Bearer YOUR_KEY'"
            if token is None
            else "incorrect API key provided"
        )
        response = error_response(401, message, None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
