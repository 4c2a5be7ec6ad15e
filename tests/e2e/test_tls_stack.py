"""Both gRPC hops over TLS and over mutual TLS, on real processes; clients without a certificate refused."""

from __future__ import annotations

import grpc
import httpx
import pytest

from protos import ar_pb2, ar_pb2_grpc
from servicekit.healthcheck import check
from servicekit.tls import ClientTLS, open_channel
from tools.local_stack import LocalStack
from tools.make_certs import make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_stack(model_dir, logs, certs, mutual: bool) -> LocalStack:
    server = ["--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key)]
    if mutual:
        server += ["--tls-client-ca-file", str(certs.ca)]
    client_cert = ["--dit-tls-cert-file", str(certs.client_cert), "--dit-tls-key-file", str(certs.client_key)] if mutual else []
    gateway_cert = ["--grpc-tls-cert-file", str(certs.client_cert), "--grpc-tls-key-file", str(certs.client_key)] if mutual else []
    harness = ClientTLS(certs.ca, certs.client_cert if mutual else None, certs.client_key if mutual else None)
    return LocalStack(
        model_dir,
        logs,
        extra={
            "dit_service": server,
            "ar_service": [*server, "--dit-tls-ca-file", str(certs.ca), *client_cert],
            "gateway": ["--grpc-tls-ca-file", str(certs.ca), *gateway_cert],
        },
        client_tls={"dit_service": harness, "ar_service": harness},
    )


@pytest.fixture(scope="module", params=["tls", "mtls"])
def secured(request, tiny_model, tmp_path_factory, certs):
    stack = tls_stack(tiny_model, tmp_path_factory.mktemp(request.param), certs, mutual=request.param == "mtls")
    stack.up()
    try:
        yield request.param, stack
    finally:
        codes = stack.down()
        assert codes["dit_service"] == codes["ar_service"] == 0, codes
        assert codes["gateway"] in (0, -15), codes  # as tests/e2e/conftest.py accepts


def test_images_travel_both_tls_hops(secured):
    _, stack = secured
    response = stack.generate({"prompt": "a padlock", "size": "64x64", "num_inference_steps": 2, "seed": 4})
    assert response.status_code == 200, response.text
    assert httpx.get(f"{stack.gateway_url}/health", timeout=10).json() == {"status": "ok", "ar": "SERVING", "dit": "SERVING"}


def test_plaintext_clients_are_refused(secured):
    _, stack = secured
    assert check(stack.ar_address, timeout=3) == "UNREACHABLE"
    assert check(stack.dit_address, timeout=3) == "UNREACHABLE"


def test_client_without_certificate_under_mutual_tls(secured, certs):
    mode, stack = secured
    expected = "UNREACHABLE" if mode == "mtls" else "SERVING"
    assert check(stack.ar_address, timeout=3, tls=ClientTLS(certs.ca)) == expected
    assert check(stack.dit_address, timeout=3, tls=ClientTLS(certs.ca)) == expected
    if mode == "mtls":
        with open_channel(stack.ar_address, ClientTLS(certs.ca)) as channel:
            with pytest.raises(grpc.RpcError) as info:
                ar_pb2_grpc.ImageGeneratorStub(channel).ListModels(ar_pb2.ListModelsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
