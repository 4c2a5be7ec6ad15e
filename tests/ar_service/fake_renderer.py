"""A Renderer servicer of a test's own on a real gRPC server on loopback: how the render-client tests stand in for
dit_service when they need it to misbehave in one precise way."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from protos import channels, dit_pb2_grpc


@contextmanager
def serve_renderer(servicer: dit_pb2_grpc.RendererServicer) -> Iterator[str]:
    """``servicer`` served on 127.0.0.1 (a free port) with the services' own server options; yields the address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channels.server_options())
    dit_pb2_grpc.add_RendererServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
