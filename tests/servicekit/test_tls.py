"""servicekit.tls over a real in-process gRPC server: TLS, mutual TLS, and refusals."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import channels
from servicekit.healthcheck import check
from servicekit.tls import ClientTLS, ServerTLS, TLSConfigError, add_port, open_channel
from tools.make_certs import make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("other"), ca_name="someone else's CA")


def serve(tls: ServerTLS):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channels.server_options())
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", tls)
    assert port
    server.start()
    return server, f"127.0.0.1:{port}"


def status(address: str, tls: ClientTLS | None) -> str:
    return check(address, timeout=3, tls=tls)


def test_tls_server_serves_a_tls_client_and_refuses_plaintext(certs, other_ca):
    server, address = serve(ServerTLS(certs.server_cert, certs.server_key))
    try:
        assert status(address, ClientTLS(certs.ca)) == "SERVING"
        assert status(address, ClientTLS(certs.ca, server_name="localhost")) == "SERVING"
        assert status(address, None) == "UNREACHABLE"  # plaintext client
        assert status(address, ClientTLS(other_ca.ca)) == "UNREACHABLE"  # does not trust the server's CA
    finally:
        server.stop(0)


def test_mutual_tls_requires_a_client_certificate_from_the_ca(certs, other_ca):
    server, address = serve(ServerTLS(certs.server_cert, certs.server_key, certs.ca))
    try:
        assert status(address, ClientTLS(certs.ca, certs.client_cert, certs.client_key)) == "SERVING"
        assert status(address, ClientTLS(certs.ca)) == "UNREACHABLE"  # no client certificate
        assert status(address, ClientTLS(certs.ca, other_ca.client_cert, other_ca.client_key)) == "UNREACHABLE"
    finally:
        server.stop(0)


def test_channel_options_are_kept_with_tls(certs):
    server, address = serve(ServerTLS(certs.server_cert, certs.server_key))
    try:
        with open_channel(address, ClientTLS(certs.ca), channels.channel_options()) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_half_configured_tls_is_an_error(certs, tmp_path):
    with pytest.raises(TLSConfigError, match="key"):
        ServerTLS(cert_file=certs.server_cert).credentials()
    with pytest.raises(TLSConfigError, match="both"):
        ClientTLS(certs.ca, cert_file=certs.client_cert).credentials()
    with pytest.raises(TLSConfigError, match="cannot read"):
        ClientTLS(tmp_path / "missing.pem").credentials()
    assert ServerTLS().credentials() is None and ClientTLS().credentials() is None
