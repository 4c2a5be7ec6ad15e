"""``python -m ar_service``: load the AR model and serve the pipeline's front door over gRPC."""

from __future__ import annotations

import logging
import sys
import time
from typing import NoReturn

from ar_service.settings import ARSettings
from servicekit import tracing
from servicekit.logs import setup_logging
from servicekit.ports import refuse_busy_ports
from servicekit.settings import load_settings

log = logging.getLogger("ar_service")


def main(argv: list[str] | None = None) -> NoReturn:
    settings = load_settings(ARSettings, argv, prog="python -m ar_service", description="ardit's AR service and front door")
    setup_logging(settings.log_level)
    refuse_busy_ports("ar_service", settings.host, settings.port, settings.metrics_port)  # before the slow imports and the load
    tracing.setup("ar_service")  # off unless the OTEL_* environment asks for it

    from ar_service.decoding.decoders import ROWS_PER_IMAGE
    from ar_service.engine import AREngine
    from ar_service.model.loading import load_ar
    from ar_service.model.static_decode import resolve_decode_kernels
    from ar_service.planning import EditLimits
    from ar_service.render_client import GrpcRenderer
    from ar_service.server import build_server
    from protos.knobs import FAMILIES
    from servicekit.checkpoint import open_checkpoint
    from servicekit.devices import pick_device, pick_dtype
    from servicekit.fp8 import check_device
    from servicekit.profiling import make_profiler

    if settings.deterministic:
        import os

        import torch

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any CUDA work
        torch.use_deterministic_algorithms(True)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    check_device(settings.quantization, device, dtype)
    checkpoint = open_checkpoint(settings.model_dir, require_weights=not settings.random_weights)
    from servicekit.lifecycle import abort_start, exit_process, install_stop_signals, stop_gracefully
    from servicekit.tls import ClientTLS, ServerTLS

    running = build_server(
        settings.host,
        settings.port,
        settings.max_workers,
        tls=ServerTLS(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file),
        max_concurrent_streams=settings.max_concurrent_streams,
        max_connection_age_s=settings.max_connection_age_s,
        max_connection_age_grace_s=settings.max_connection_age_grace_s,
    )
    running.servicer.log_prompts = settings.log_prompts
    running.server.start()
    log.info(
        "ar_service listening on %s:%d, loading %s on %s (%s%s%s)",
        settings.host, running.port, checkpoint.root, device, dtype, ", random weights" if settings.random_weights else "",
        ", fp8 weights" if settings.quantization == "fp8" else "",
    )
    # Loading and the engine's warm-up (decode graphs, compilation) both run after the server listens.
    try:
        load_started = time.perf_counter()
        loaded = load_ar(checkpoint, device=device, dtype=dtype, random_weights=settings.random_weights,
                         quantization=settings.quantization)
        dit_tls = ClientTLS(
            settings.dit_tls_ca_file, settings.dit_tls_cert_file, settings.dit_tls_key_file, settings.dit_tls_server_name
        )
        renderer = GrpcRenderer(settings.dit_address, tls=dit_tls, model=checkpoint.identity)
        engine = AREngine(
            loaded,
            checkpoint,
            FAMILIES[checkpoint.family],
            renderer,
            model_id=settings.model_id,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_pixels=settings.max_pixels,
            edit_limits=EditLimits(settings.edit_max_image_bytes, settings.edit_max_total_bytes,
                                   settings.edit_max_image_pixels, settings.edit_image_positions),
            max_batch_size=settings.max_batch_size,
            max_queued_requests=settings.max_queued_requests,
            prefix_cache=settings.prefix_cache,
            prefill_memo=settings.prefill_memo,
            fast_decode=settings.fast_decode == "on" or (settings.fast_decode == "auto" and device.type == "cuda"),
            compile_decode=settings.compile_decode and device.type == "cuda",
            compile_decode_mode=settings.compile_decode_mode,
            decode_kernels=resolve_decode_kernels(
                settings.decode_kernels, device, ROWS_PER_IMAGE * settings.max_batch_size, dtype,
                fp8=settings.quantization == "fp8",
            ),
            decode_lookahead=settings.decode_lookahead,
            capture_lane_graphs=settings.capture_lane_graphs,
            decode_lane_rows=settings.decode_lane_rows,
            decode_lane_attention=settings.decode_lane_attention,
            deterministic=settings.deterministic,
            profiler=make_profiler("ar_service", settings.profile_dir, device, settings.profile_max_traces),
            gpu_memory_utilization=settings.gpu_memory_utilization,
        )
    except BaseException:
        abort_start("ar_service", running.server)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.host, registry=engine.metrics.registry)
        log.info("ar_service metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    running.servicer.engine = engine
    running.set_serving(True)
    log.info(
        "ar_service ready on %s:%d (model %s, renderer at %s): loaded in %.1f s, %d parameters",
        settings.host, running.port, engine.model_id, settings.dit_address, time.perf_counter() - load_started,
        sum(p.numel() for p in loaded.model.parameters()),
    )

    stop = install_stop_signals()
    stop.wait()
    stop_gracefully("ar_service", running.server, running.set_serving, settings.shutdown_drain_s, settings.shutdown_grace_s)
    engine.close()
    renderer.close()
    tracing.shutdown()  # exit_process skips atexit: export the spans still buffered
    exit_process(0)


if __name__ == "__main__":
    sys.exit(main())
