"""A Renderer servicer of a test's own on a real gRPC server on loopback: how the render-client tests stand in for
dit_service when they need it to misbehave in one precise way."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from ar_service.render_client import RenderHeader
from protos import channels, dit_pb2_grpc


def render_header(request_id: str, **fields) -> RenderHeader:
    """A one-image header of a 64x64 float32 render (8 hidden units, no condition rows unless ``fields`` say)."""
    defaults = dict(index=0, width=64, height=64, seed=3, output_format="png", output_compression=None, knobs={},
                    hidden_size=8, dtype="float32", text_positions=0, image_positions=0, negative_positions=0)
    return RenderHeader(request_id=request_id, **{**defaults, **fields})


def start_renderer(servicer: dit_pb2_grpc.RendererServicer, max_workers: int = 4) -> tuple[grpc.Server, str]:
    """``servicer`` served on 127.0.0.1 (a free port) with the services' own server options: the server, its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=channels.server_options())
    dit_pb2_grpc.add_RendererServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@contextmanager
def serve_renderer(servicer: dit_pb2_grpc.RendererServicer) -> Iterator[str]:
    """``start_renderer`` for the length of a ``with`` block; yields the address."""
    server, address = start_renderer(servicer)
    try:
        yield address
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
    server, address = start_renderer(SilentRenderer(), max_workers=32)
    print(address, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
