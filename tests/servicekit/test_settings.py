"""Settings precedence: default < YAML < environment < explicit flag (even one equal to the default)."""

from pathlib import Path

import pytest

from ar_service.settings import ARSettings
from dit_service.settings import DiTSettings
from servicekit.settings import load_settings


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    path = tmp_path / "ar.yaml"
    path.write_text("port: 6000\ndit_address: dit:7000\nmax_prompt_tokens: 64\n")
    return path


def test_defaults_work_alone(monkeypatch):
    for name in ("ARDIT_AR_PORT", "ARDIT_AR_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings(ARSettings, [])
    assert settings.port == 50051
    assert settings.dit_address == "127.0.0.1:50052"
    assert load_settings(DiTSettings, []).port == 50052


def test_yaml_overrides_defaults(yaml_file):
    settings = load_settings(ARSettings, ["--config", str(yaml_file)])
    assert (settings.port, settings.dit_address, settings.max_prompt_tokens) == (6000, "dit:7000", 64)


def test_environment_overrides_yaml(yaml_file, monkeypatch):
    monkeypatch.setenv("ARDIT_AR_PORT", "6100")
    settings = load_settings(ARSettings, ["--config", str(yaml_file)])
    assert settings.port == 6100
    assert settings.dit_address == "dit:7000"


def test_yaml_path_from_environment(yaml_file, monkeypatch):
    monkeypatch.setenv("ARDIT_AR_CONFIG", str(yaml_file))
    assert load_settings(ARSettings, []).port == 6000


def test_explicit_flag_equal_to_default_still_wins(yaml_file, monkeypatch):
    monkeypatch.setenv("ARDIT_AR_PORT", "6100")
    settings = load_settings(ARSettings, ["--config", str(yaml_file), "--port", "50051", "--max-prompt-tokens", "1024"])
    assert settings.port == 50051
    assert settings.max_prompt_tokens == 1024


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("prot: 1\n")
    with pytest.raises(Exception, match="prot"):
        load_settings(ARSettings, ["--config", str(path)])


def test_bad_flag_value_is_an_error(capsys):
    with pytest.raises(SystemExit):
        load_settings(DiTSettings, ["--port", "eleven"])
    assert "--port" in capsys.readouterr().err


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as info:
        load_settings(DiTSettings, ["--help"], prog="python -m dit_service")
    assert info.value.code == 0
    text = capsys.readouterr().out
    for name in DiTSettings.model_fields:
        assert "--" + name.replace("_", "-") in text
    assert "ARDIT_DIT_PORT" in text
