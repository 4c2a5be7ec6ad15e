"""compose.yaml and the Dockerfile: valid by the Compose spec, and wired the way the README says."""

import json
import os
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

from ar_service.settings import ARSettings
from dit_service.settings import DiTSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_BINARY = Path(compose.__file__).parent / "docker-compose"


def run_compose(*files: Path, args: tuple[str, ...], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The Compose binary on ``files`` (later ones override earlier ones), e.g. ``args=("config", "-q")``."""
    flags = [arg for path in files for arg in ("-f", str(path))]
    return subprocess.run([str(COMPOSE_BINARY), *flags, *args], capture_output=True, text=True, timeout=60, env=env)


def compose_config(path: Path) -> subprocess.CompletedProcess:
    return run_compose(path, args=("config", "-q"))


def resolved_gpu_config(env: dict[str, str]) -> dict:
    """compose.yaml with the compose.gpu.yaml override, resolved by the Compose binary in environment ``env``."""
    result = run_compose(ROOT / "compose.yaml", ROOT / "compose.gpu.yaml", args=("config", "--format", "json"), env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_is_valid_by_the_compose_spec():
    result = compose_config(ROOT / "compose.yaml")
    assert result.returncode == 0, result.stderr


def test_the_validator_does_reject_an_invalid_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  gateway:\n    image: x\n    ports: 8000\n    healthcheck: {interval: soon}\n")
    assert compose_config(broken).returncode != 0


def test_three_services_from_one_image_with_grpc_health_checks():
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    for name, port in (("ar", "50051"), ("dit", "50052")):
        service = services[name]
        assert service["build"] == "." and service["image"] == "ardit:latest"
        assert "servicekit.healthcheck" in service["healthcheck"]["test"]
        assert f"127.0.0.1:{port}" in service["healthcheck"]["test"]
        assert "models:/models" in service["volumes"]
    assert services["gateway"]["image"] == "ardit:latest"
    assert services["gateway"]["ports"] == ["8000:8000"]
    assert services["ar"]["depends_on"]["dit"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["ar"]["condition"] == "service_healthy"
    assert "models" in spec["volumes"]


def grpc_target(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_the_model_services_scale_behind_their_service_names():
    """`docker compose up --scale dit=2 --scale ar=2`: only the gateway publishes a port, clients resolve every replica."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name in ("ar", "dit"):
        assert not {"container_name", "hostname", "ports"} & services[name].keys(), name  # each would clash between replicas
    assert grpc_target(services["ar"]["command"], "--dit-address") == "dns:///dit:50052"
    assert grpc_target(services["gateway"]["command"], "--ar-address") == "dns:///ar:50051"
    assert grpc_target(services["gateway"]["command"], "--dit-address") == "dns:///dit:50052"


def scaled(tmp_path: Path, extra: str = "") -> subprocess.CompletedProcess:
    """compose.yaml with two replicas of ar and dit (what --scale sets), resolved by the Compose binary."""
    override = tmp_path / "compose.scale.yaml"
    override.write_text(f"services:\n  ar:\n    deploy: {{replicas: 2}}\n  dit:\n    deploy: {{replicas: 2}}\n{extra}")
    return run_compose(ROOT / "compose.yaml", override, args=("config", "--format", "json"))


def test_two_replicas_of_each_model_service_are_a_valid_project(tmp_path):
    result = scaled(tmp_path)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["ar"]["deploy"]["replicas"] == services["dit"]["deploy"]["replicas"] == 2
    assert [port["published"] for port in services["gateway"]["ports"]] == ["8000"]


def test_the_compose_check_does_reject_a_fixed_container_name_on_a_scaled_service(tmp_path):
    result = scaled(tmp_path, extra="    container_name: ardit-dit\n")
    assert result.returncode != 0 and "container_name" in result.stderr


def gpus(service: dict) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [gpu for device in devices if device["driver"] == "nvidia" for gpu in device["device_ids"]]


def test_the_gpu_override_gives_each_model_service_one_gpu_chosen_by_environment():
    """Both model services share GPU 0 by default; ARDIT_DIT_GPU / ARDIT_AR_GPU move them; the gateway has none."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_")}
    with_defaults = resolved_gpu_config(env)["services"]
    assert gpus(with_defaults["ar"]) == ["0"] and gpus(with_defaults["dit"]) == ["0"]
    assert gpus(with_defaults["gateway"]) == []
    split = resolved_gpu_config({**env, "ARDIT_DIT_GPU": "1"})["services"]
    assert gpus(split["ar"]) == ["0"] and gpus(split["dit"]) == ["1"]
    assert split["ar"]["command"] == with_defaults["ar"]["command"]  # the override only adds devices


def test_the_gpu_override_passes_each_stage_its_quantization_from_the_environment(monkeypatch):
    """bf16 (none) unless ARDIT_DIT_QUANTIZATION / ARDIT_AR_QUANTIZATION choose fp8, each for its own service; what
    Compose passes is what each service's settings read."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_")}
    for key in os.environ:
        if key.startswith("ARDIT_"):
            monkeypatch.delenv(key)
    with_defaults = resolved_gpu_config(env)["services"]
    mixed = resolved_gpu_config({**env, "ARDIT_DIT_QUANTIZATION": "fp8"})["services"]
    assert "QUANTIZATION" not in json.dumps(with_defaults["gateway"])
    for services, expected in ((with_defaults, {"dit": "none", "ar": "none"}), (mixed, {"dit": "fp8", "ar": "none"})):
        for service, settings in (("dit", DiTSettings), ("ar", ARSettings)):
            with monkeypatch.context() as patched:
                for key, value in services[service]["environment"].items():
                    patched.setenv(key, value)
                assert settings().quantization == expected[service], (service, services[service]["environment"])


def test_dockerfile_copies_every_package_and_runs_as_non_root():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = ["protos", "servicekit", "ar_service", "dit_service", "gateway", "tools", "ardit_cli"]
    for package in packages:
        assert f'"{package}*"' in pyproject
        assert f"COPY {package} ./{package}" in dockerfile
    user_lines = [line for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert user_lines and user_lines[-1] != "USER root"


@pytest.mark.parametrize("module", ["ar_service", "dit_service", "gateway"])
def test_each_service_explains_itself_with_help(module):
    import sys

    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--port" in result.stdout and "--config" in result.stdout


def test_gateway_keeps_url_images_in_a_shared_volume():
    """response_format "url": the gateway's image store is a directory in the `images` volume, owned by the service user."""
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    gateway = spec["services"]["gateway"]
    assert "images:/images" in gateway["volumes"] and "models:/models" in gateway["volumes"]
    assert gateway["environment"]["ARDIT_GATEWAY_IMAGE_STORE_DIR"] == "/images"
    assert "images" in spec["volumes"]
    assert "chown ardit:ardit /models /images" in (ROOT / "Dockerfile").read_text()
