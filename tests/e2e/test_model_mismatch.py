"""An AR paired with a DiT of another model: refused by the DiT before anything is rendered, a 503 naming both
models at the gateway, and /health saying why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from protos import common_pb2, dit_pb2, dit_pb2_grpc
from servicekit.checkpoint import open_checkpoint
from tests.e2e.conftest import ROOT, Stack, running_stack

SHAPES = ROOT / "train" / "checkpoints" / "shapes"


@pytest.fixture(scope="module")
def mismatched(tiny_model: Path, tmp_path_factory) -> Iterator[Stack]:
    """The AR on the tiny model, the DiT on the trained shapes model."""
    with running_stack(tiny_model, tmp_path_factory.mktemp("logs"), dit_model_dir=SHAPES) as running:
        yield running


def _dit_status(address: str) -> common_pb2.EngineStatus:
    with grpc.insecure_channel(address) as channel:
        return dit_pb2_grpc.RendererStub(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=10)


def test_generation_is_refused_with_503_naming_both_models(mismatched: Stack) -> None:
    tiny = open_checkpoint(mismatched.model_dir).identity
    shapes = open_checkpoint(SHAPES).identity
    assert tiny != shapes
    answer = httpx.post(
        f"{mismatched.gateway_url}/v1/images/generations", json={"prompt": "a red circle", "size": "64x64"}, timeout=60
    )
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_mismatch"
    assert error["param"] == "model"
    for identity in (tiny, shapes):
        assert f"'{identity.name}'" in error["message"] and identity.fingerprint in error["message"]
    # nothing was rendered from the tiny AR's condition: refused at the header, never admitted
    status = _dit_status(mismatched.dit_address)
    assert status.admitted_total == 0 and status.completed_total == 0

    health = httpx.get(f"{mismatched.gateway_url}/health", timeout=10)
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "unavailable" and body["ar"] == body["dit"] == "SERVING"
    assert "'tiny'" in body["fault"] and "'shapes'" in body["fault"]


def test_streaming_generation_is_refused_naming_both_models(mismatched: Stack) -> None:
    with httpx.stream(
        "POST", f"{mismatched.gateway_url}/v1/images/generations",
        json={"prompt": "a blue square", "size": "64x64", "stream": True, "partial_images": 1}, timeout=60,
    ) as answer:
        text = answer.read().decode()
    assert "'tiny'" in text and "'shapes'" in text, text


def test_dit_refuses_a_header_of_another_model_before_any_condition(mismatched: Stack) -> None:
    """Straight to the DiT: FAILED_PRECONDITION naming both, answered at the header."""
    header = dit_pb2.RenderHeader(
        request_id="other-model", width=64, height=64, n=1, seed=1, hidden_size=128, dtype="float32",
        text_positions=4, image_positions=0, model=common_pb2.ModelIdentity(name="elsewhere", fingerprint="0123456789ab"),
    )
    with grpc.insecure_channel(mismatched.dit_address) as channel:
        call = dit_pb2_grpc.RendererStub(channel).Render(iter([dit_pb2.RenderInput(header=header)]), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'elsewhere'" in caught.value.details() and "'shapes'" in caught.value.details()


def test_a_matching_pair_serves_and_health_is_ok(stack: Stack) -> None:
    answer = httpx.post(f"{stack.gateway_url}/v1/images/generations", json={"prompt": "a dot", "size": "64x64"}, timeout=120)
    assert answer.status_code == 200, answer.text
    health = httpx.get(f"{stack.gateway_url}/health", timeout=10)
    assert health.status_code == 200 and "fault" not in health.json()
