"""The gateway's model_aliases setting: how it is given, what a request with an alias becomes, how /v1/models
lists aliases, the 404 for a name that is neither; and response_format's default for DALL-E model names."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from gateway import errors, translate
from gateway.protocol import ImageGenerationRequest
from gateway.settings import GatewaySettings
from protos import ar_pb2
from protos.status import PARAM_METADATA_KEY
from servicekit.settings import load_settings
from tests.gateway.test_gateway_translate import FakeRpcError
from tools import run_all

ROOT = Path(__file__).resolve().parents[2]

ALIASES = {"dall-e-2": "shapes", "dall-e-3": "shapes"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("ARDIT_GATEWAY_MODEL_ALIASES", raising=False)
    monkeypatch.delenv("ARDIT_GATEWAY_CONFIG", raising=False)


def test_none_by_default():
    assert GatewaySettings().model_aliases == {}


@pytest.mark.parametrize(
    "given", ["dall-e-2=shapes,dall-e-3=shapes", " dall-e-2 = shapes , dall-e-3=shapes, ", '{"dall-e-2": "shapes", "dall-e-3": "shapes"}']
)
def test_flag_and_env_forms(given, monkeypatch):
    assert load_settings(GatewaySettings, ["--model-aliases", given]).model_aliases == ALIASES
    monkeypatch.setenv("ARDIT_GATEWAY_MODEL_ALIASES", given)
    assert GatewaySettings().model_aliases == ALIASES


def test_yaml_mapping(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("model_aliases:\n  dall-e-2: shapes\n")
    assert load_settings(GatewaySettings, ["--config", str(path)]).model_aliases == {"dall-e-2": "shapes"}


def test_empty_means_none(monkeypatch):
    monkeypatch.setenv("ARDIT_GATEWAY_MODEL_ALIASES", "")
    assert GatewaySettings().model_aliases == {}


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("dall-e-2", "ALIAS=MODEL"),
        ("dall-e-2=", "ALIAS=MODEL"),
        ("a=shapes,a=tiny", "twice"),
        ("shapes=shapes", "alias of itself"),
        ("a=b,b=shapes", "itself an alias"),
        ("bad name=shapes", "model names"),
    ],
)
def test_bad_aliases_are_refused_at_start(given, says):
    with pytest.raises(ValueError, match=says):
        GatewaySettings(model_aliases=given)


def request(**fields) -> ImageGenerationRequest:
    return ImageGenerationRequest.model_validate({"prompt": "a cat", **fields})


def test_an_alias_becomes_the_model_it_stands_for_other_names_pass_unchanged():
    assert translate.to_proto(request(model="dall-e-2"), model_aliases=ALIASES).model == "shapes"
    assert translate.to_proto(request(model="shapes"), model_aliases=ALIASES).model == "shapes"
    assert translate.to_proto(request(model="gpt-image-1"), model_aliases=ALIASES).model == "gpt-image-1"
    assert translate.to_proto(request(), model_aliases=ALIASES).model == ""
    assert translate.to_proto(request(model="dall-e-2")).model == "dall-e-2"  # no aliases: ar_service judges (404)


def test_models_list_served_first_then_each_alias_marked():
    reply = ar_pb2.ListModelsResponse(models=[ar_pb2.ModelCard(id="shapes", family="mammothmoda2", max_upscale=8)])
    listed = translate.models_to_openai(reply, {**ALIASES, "other": "not-served"})["data"]
    assert [(m["id"], m["ardit"]["alias_of"]) for m in listed] == [("shapes", None), ("dall-e-2", "shapes"), ("dall-e-3", "shapes")]
    assert all(m["ardit"]["max_upscale"] == 8 for m in listed)
    assert translate.models_to_openai(reply)["data"][0]["ardit"]["max_upscale"] == 8


def test_unknown_model_404_names_the_aliases():
    error = FakeRpcError(grpc.StatusCode.NOT_FOUND, "model 'x' is not served here; served models: shapes",
                         ((PARAM_METADATA_KEY, "model"),))
    with_aliases = errors.from_rpc_error(error, "ar:1", ALIASES)
    assert with_aliases.status == 404 and with_aliases.param == "model"
    assert with_aliases.message.endswith("aliases: dall-e-2 (= shapes), dall-e-3 (= shapes)")
    assert "none set" in errors.from_rpc_error(error, "ar:1").message


@pytest.mark.parametrize(
    ("fields", "answer"),
    [
        ({}, "b64_json"),
        ({"model": "shapes"}, "b64_json"),
        ({"model": "dall-e-2"}, "url"),
        ({"model": "dall-e-3"}, "url"),
        ({"model": "dall-e-2", "response_format": "b64_json"}, "b64_json"),
        ({"model": "shapes", "response_format": "url"}, "url"),
    ],
)
def test_response_format_left_out_follows_openai_per_model_name(fields, answer):
    assert request(**fields).answer_format == answer


def test_make_up_and_compose_let_the_same_openai_names_stand_for_the_same_served_model():
    """tools.run_all's default aliases (make up) and compose.yaml's default ARDIT_MODEL_ALIASES are the same names,
    OpenAI's image models among them (LibreChat's gpt-image-1 as well as the DALL-E names), and stand for the model
    both serve by default: the model id is the model directory's name."""
    compose = (ROOT / "compose.yaml").read_text()
    line = next(line for line in compose.splitlines() if "ARDIT_GATEWAY_MODEL_ALIASES:" in line)
    match = re.search(r"\$\{ARDIT_MODEL_ALIASES-([^}]*)\}", line)
    assert match is not None, line
    served = run_all.DEFAULT_MODEL_DIR.name
    assert set(re.findall(r"\$\{ARDIT_MODEL:-/app/models/([^}]*)\}", compose)) == {served}
    assert GatewaySettings(model_aliases=match.group(1)).model_aliases == {name: served for name in run_all.DEFAULT_ALIASES}
    assert {"dall-e-2", "dall-e-3", "gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5"} <= set(run_all.DEFAULT_ALIASES)


def test_run_all_alone_serves_what_make_up_serves():
    """``python -m tools.run_all`` without --model-dir serves the Dev shapes model, the Makefile's MODEL_DIR default."""
    makefile = (ROOT / "Makefile").read_text()
    make_default = re.search(r"^MODEL_DIR \?= (\S+)$", makefile, re.MULTILINE)
    assert make_default is not None
    assert run_all.DEFAULT_MODEL_DIR == ROOT / make_default.group(1)
    assert (run_all.DEFAULT_MODEL_DIR / "config.json").is_file()
