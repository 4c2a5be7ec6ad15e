"""GatewaySettings precedence, the command line, and the no-torch rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from servicekit.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
ENV = ("ARDIT_GATEWAY_PORT", "ARDIT_GATEWAY_AR_ADDRESS", "ARDIT_GATEWAY_CONFIG", "ARDIT_GATEWAY_REQUEST_TIMEOUT_S")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text("port: 9000\nar_address: ar:7000\nrequest-timeout-s: 30\n")
    return path


def test_defaults():
    settings = load_settings(GatewaySettings, [])
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert (settings.ar_address, settings.dit_address) == ("127.0.0.1:50051", "127.0.0.1:50052")
    assert settings.request_timeout_s == 600.0 and settings.max_body_bytes == 1_048_576
    assert settings.log_level == "info"
    assert all(info.description for info in GatewaySettings.model_fields.values())


def test_yaml_over_defaults(yaml_file):
    settings = load_settings(GatewaySettings, ["--config", str(yaml_file)])
    assert (settings.port, settings.ar_address, settings.request_timeout_s) == (9000, "ar:7000", 30.0)


def test_env_over_yaml(yaml_file, monkeypatch):
    monkeypatch.setenv("ARDIT_GATEWAY_PORT", "9100")
    monkeypatch.setenv("ARDIT_GATEWAY_CONFIG", str(yaml_file))
    settings = load_settings(GatewaySettings, [])
    assert settings.port == 9100
    assert settings.ar_address == "ar:7000"


def test_explicit_flag_equal_to_default_wins(yaml_file, monkeypatch):
    monkeypatch.setenv("ARDIT_GATEWAY_PORT", "9100")
    monkeypatch.setenv("ARDIT_GATEWAY_AR_ADDRESS", "env:1")
    settings = load_settings(
        GatewaySettings,
        ["--config", str(yaml_file), "--port", "8000", "--ar-address", "127.0.0.1:50051", "--request-timeout-s", "600"],
    )
    assert settings.port == 8000
    assert settings.ar_address == "127.0.0.1:50051"
    assert settings.request_timeout_s == 600.0


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("prot: 1\n")
    with pytest.raises(Exception, match="prot"):
        load_settings(GatewaySettings, ["--config", str(path)])


def test_importing_the_app_does_not_import_torch():
    code = "import sys, gateway.app, gateway.__main__; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_help_lists_the_settings():
    result = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in ("--host", "--port", "--ar-address", "--dit-address", "--request-timeout-s", "--max-body-bytes",
                 "--log-level", "--config", "ARDIT_GATEWAY_PORT"):
        assert flag in result.stdout
