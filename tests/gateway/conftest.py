"""Gateway tests need no backend: the configured addresses are free localhost ports."""

from __future__ import annotations

import socket

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings

SMALL_BODY_LIMIT = 4096


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def settings() -> GatewaySettings:
    return GatewaySettings(
        ar_address=f"127.0.0.1:{free_port()}",
        dit_address=f"127.0.0.1:{free_port()}",
        max_body_bytes=SMALL_BODY_LIMIT,
        request_timeout_s=10.0,
    )


@pytest.fixture(scope="module")
def client(settings) -> TestClient:
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def _assert_openai_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    assert "Traceback" not in response.text
    return error


@pytest.fixture
def openai_error():
    """``openai_error(response, status, param)`` asserts OpenAI's error shape and returns ``error``."""
    return _assert_openai_error
