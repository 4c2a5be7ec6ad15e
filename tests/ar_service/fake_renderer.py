"""A Renderer servicer of a test's own on a real gRPC server on loopback: how the render-client tests stand in for
dit_service when they need it to misbehave in one precise way."""

from __future__ import annotations

import threading
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


class SilentRenderer(dit_pb2_grpc.RendererServicer):
    """Reads every Render stream to its end, prints each header's request id, never answers: a replica that is
    still taking its input when it dies."""

    def Render(self, request_iterator, context):
        for message in request_iterator:
            if message.WhichOneof("input") == "header":
                print(message.header.request_id, flush=True)
        threading.Event().wait()  # until the process is killed
        yield from ()


def main() -> None:
    """``python -m tests.ar_service.fake_renderer``: a SilentRenderer in a process of its own (so that a test
    can SIGKILL it mid-stream); prints its address, then one line per header received."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=channels.server_options())
    dit_pb2_grpc.add_RendererServicer_to_server(SilentRenderer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
