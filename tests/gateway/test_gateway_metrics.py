"""429 with the service's own Retry-After, and the gateway's Prometheus metrics at GET /metrics."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from protos import ar_pb2_grpc, channels

URL = "/v1/images/generations"


class Busy(ar_pb2_grpc.ImageGeneratorServicer):
    def StreamImage(self, request, context):
        if request.prompt == "busy, with a hint":
            context.set_trailing_metadata((("retry-after", "7"),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "dit_service is at capacity")


@pytest.fixture(scope="module")
def client():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channels.server_options())
    ar_pb2_grpc.add_ImageGeneratorServicer_to_server(Busy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    with TestClient(create_app(GatewaySettings(ar_address=address, dit_address=address)),
                    raise_server_exceptions=False) as test_client:
        yield test_client
    server.stop(grace=None)


def test_resource_exhausted_is_429_with_the_services_retry_after(client):
    response = client.post(URL, json={"prompt": "busy, with a hint"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert response.json()["error"] == {"message": "dit_service is at capacity", "type": "rate_limit_error",
                                        "param": None, "code": "resource_exhausted"}
    plain = client.post(URL, json={"prompt": "busy"})
    assert plain.status_code == 429 and plain.headers["retry-after"] == "1"  # the default when the service is silent


def test_metrics_count_requests_by_status_with_latency_and_in_flight(client):
    for _ in range(2):
        client.post(URL, json={"prompt": "busy"})
    client.post(URL, json={"prompt": ""})  # a 400
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'ardit_gateway_requests_total{route="/v1/images/generations",status="429"}' in text
    assert 'ardit_gateway_requests_total{route="/v1/images/generations",status="400"}' in text
    assert 'ardit_gateway_request_seconds_bucket{le="0.01",route="/v1/images/generations"}' in text
    assert "ardit_gateway_requests_in_flight 1.0" in text  # the /metrics request itself
    client.get("/v1/no/such/route")
    assert 'route="other",status="404"' in client.get("/metrics").text
