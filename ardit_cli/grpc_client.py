"""The gRPC transport: ar_service's ImageGenerator (ListModels, StreamImage, EditImage), straight past the gateway.

StreamImage sends a progress event per grid row of the AR and per denoising step of the DiT, each image as it
is done, partial images when they were asked for, then a summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from ardit_cli.models import ModelCard
from ardit_cli.request import CLIError, ImageRequest, Reporter
from protos import ar_pb2, ar_pb2_grpc, channels
from protos.formats import format_enum
from protos.status import effective_code, param_of
from protos.values import knobs_to_proto
from servicekit.tls import ClientTLS, open_channel


class GrpcClient:
    def __init__(
        self, address: str, timeout: float = 600.0, tls_ca: Path | None = None, tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, ClientTLS(tls_ca, tls_cert, tls_key), channels.channel_options())
        self.stub = ar_pb2_grpc.ImageGeneratorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def models(self) -> list[ModelCard]:
        try:
            reply = self.stub.ListModels(ar_pb2.ListModelsRequest(), timeout=min(self.timeout, 10.0))
        except grpc.RpcError as exc:
            raise CLIError(self._error_text(exc)) from None
        return [ModelCard.from_proto(card) for card in reply.models]

    def generate(self, request: ImageRequest, reporter: Reporter) -> None:
        """StreamImage, or EditImage when the request carries input images (their files in pieces after it)."""
        if request.images:
            from gateway.edits import edit_messages  # the one owner of the EditImage stream's layout

            call = self.stub.EditImage(edit_messages(self._message(request), request.images), timeout=self.timeout)
        else:
            call = self.stub.StreamImage(self._message(request), timeout=self.timeout)
        try:
            for event in call:
                self._deliver(event, reporter)
        except grpc.RpcError as exc:
            raise CLIError(self._error_text(exc)) from None
        finally:
            call.cancel()  # a no-op once the stream ended; on Ctrl-C it stops the request on the server

    @staticmethod
    def _message(request: ImageRequest) -> ar_pb2.GenerateImageRequest:
        from gateway.protocol import parse_size  # the one owner of the size syntax ("auto" or WxH)

        try:
            width, height = parse_size(request.size)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
        message = ar_pb2.GenerateImageRequest(
            prompt=request.prompt, negative_prompt=request.negative_prompt or "", model=request.model or "",
            width=width, height=height, n=request.n, quality=request.quality,
            output_format=format_enum(request.output_format), knobs=knobs_to_proto(request.knobs),
        )
        if request.seed is not None:
            message.seed = request.seed
        if request.output_compression is not None:
            message.output_compression = request.output_compression
        message.partial_images = request.partial_images
        return message

    @staticmethod
    def _deliver(event: ar_pb2.ImageEvent, reporter: Reporter) -> None:
        kind = event.WhichOneof("event")
        if kind == "progress":
            p = event.progress
            reporter.progress(p.index, p.stage, p.step, p.total)
        elif kind == "image":
            image = event.image
            reporter.image(image.index, image.seed, image.data, image.width, image.height)
        elif kind == "preview":
            preview: Any = getattr(event, kind)
            reporter.preview(preview.index, preview.partial_index, preview.data)
        elif kind == "completed":
            summary = event.completed
            timings = {f.name: getattr(summary.timings, f.name) for f in summary.timings.DESCRIPTOR.fields}
            reporter.completed(summary.request_id, summary.seed, timings)

    def _error_text(self, exc: grpc.RpcError) -> str:
        code = effective_code(exc)
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"cannot reach ar_service at {self.address}: {exc.details()}"
        param = param_of(exc)
        return f"{exc.details()}{f' (parameter: {param})' if param else ''} [{code.name}]"
