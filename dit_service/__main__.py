"""``python -m dit_service``: load the DiT stack and serve Render over gRPC."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import NoReturn

from dit_service.settings import DiTSettings
from servicekit import tracing
from servicekit.logs import setup_logging
from servicekit.ports import refuse_busy_ports
from servicekit.settings import load_settings

log = logging.getLogger("dit_service")


def main(argv: list[str] | None = None) -> NoReturn:
    settings = load_settings(DiTSettings, argv, prog="python -m dit_service", description="ardit's DiT rendering service")
    setup_logging(settings.log_level)
    refuse_busy_ports("dit_service", settings.host, settings.port, settings.metrics_port)  # before the slow imports and the load
    tracing.setup("dit_service")  # off unless the OTEL_* environment asks for it

    from dit_service.engine import DiTEngine
    from dit_service.model.pipeline import DiTPipeline
    from dit_service.server import build_server
    from protos.knobs import FAMILIES
    from servicekit.checkpoint import open_checkpoint
    from servicekit.devices import pick_device, pick_dtype
    from servicekit.fp8 import check_device
    from servicekit.profiling import make_profiler

    if settings.deterministic:
        # Before the first CUDA call: cuBLAS needs a fixed workspace for reproducible GEMMs, and PyTorch then refuses
        # (raises on) any kernel it has no deterministic implementation of.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    check_device(settings.quantization, device, dtype)
    checkpoint = open_checkpoint(settings.model_dir, require_weights=not settings.random_weights)
    from servicekit.lifecycle import abort_start, exit_process, install_stop_signals, stop_gracefully
    from servicekit.tls import ServerTLS

    running = build_server(
        settings.host,
        settings.port,
        settings.max_workers,
        tls=ServerTLS(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file),
        max_concurrent_streams=settings.max_concurrent_streams,
        max_connection_age_s=settings.max_connection_age_s,
        max_connection_age_grace_s=settings.max_connection_age_grace_s,
        # a Render message is a header or one chunk: a little over the largest chunk is all it needs
        max_receive_message_bytes=settings.max_chunk_bytes + 1024 * 1024,
    )
    running.server.start()
    log.info(
        "dit_service listening on %s:%d, loading %s on %s (%s%s)%s", settings.host, running.port, checkpoint.root,
        device, dtype, ", fp8 matmuls" if settings.quantization == "fp8" else "",
        " with random weights" if settings.random_weights else "",
    )
    load_started = time.perf_counter()
    try:
        pipeline = DiTPipeline.from_checkpoint(checkpoint, device=device, dtype=dtype, random_weights=settings.random_weights)
        pipeline.quantize(settings.quantization)
        pipeline.use_cuda_graphs(settings.cuda_graphs)
        if settings.warm_up:
            log.info("dit_service warmed up in %.1f s", pipeline.warm_up())
        engine = DiTEngine(
            pipeline,
            FAMILIES[checkpoint.family],
            settings.max_condition_positions,
            max_side=settings.max_side,
            max_pixels=settings.max_pixels,
            max_chunk_bytes=settings.max_chunk_bytes,
            max_condition_chunks=settings.max_condition_chunks,
            max_reference_bytes=settings.max_reference_bytes,
            png_compress_level=settings.png_compress_level,
            max_batch_size=settings.max_batch_size,
            max_queued_renders=settings.max_queued_renders,
            deterministic=settings.deterministic,
            batch_window_s=settings.batch_window_s,
            profiler=make_profiler("dit_service", settings.profile_dir, device, settings.profile_max_traces),
            knob_defaults=checkpoint.serving.knob_defaults,
            identity=checkpoint.identity,
        )
    except BaseException:
        abort_start("dit_service", running.server)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.host, registry=engine.metrics.registry)
        log.info("dit_service metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    running.servicer.engine = engine
    running.set_serving(True)
    counts = {
        name: sum(p.numel() for p in module.parameters())
        for name, module in (("dit", pipeline.transformer), ("vae", pipeline.vae), ("refiner", pipeline.refiner))
        if module is not None
    }
    log.info(
        "dit_service ready on %s:%d: loaded in %.1f s, parameters %s",
        settings.host, running.port, time.perf_counter() - load_started, counts,
    )

    stop = install_stop_signals()
    stop.wait()
    stop_gracefully("dit_service", running.server, running.set_serving, settings.shutdown_drain_s, settings.shutdown_grace_s)
    engine.close()
    tracing.shutdown()  # exit_process skips atexit: export the spans still buffered
    exit_process(0)


if __name__ == "__main__":
    sys.exit(main())
