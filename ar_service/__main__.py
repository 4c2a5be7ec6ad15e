"""``python -m ar_service``: load the AR model and serve the pipeline's front door over gRPC."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from ar_service.settings import ARSettings
from servicekit.logs import setup_logging
from servicekit.settings import load_settings

log = logging.getLogger("ar_service")


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(ARSettings, argv, prog="python -m ar_service", description="ardit's AR service and front door")
    setup_logging(settings.log_level)

    from ar_service.engine import AREngine
    from ar_service.model.loading import load_ar
    from ar_service.render_client import GrpcRenderer
    from ar_service.server import build_server
    from protos.knobs import FAMILIES
    from servicekit.devices import pick_device, pick_dtype
    from servicekit.model_index import read_model_index

    index = read_model_index(settings.model_dir)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    running = build_server(settings.host, settings.port, settings.max_workers)
    running.server.start()
    log.info("ar_service listening on %s:%d, loading %s on %s (%s)", settings.host, running.port, index.ar, device, dtype)
    try:
        loaded = load_ar(index.ar, device=device, dtype=dtype)
    except BaseException:
        running.server.stop(0)
        raise
    renderer = GrpcRenderer(settings.dit_address)
    engine = AREngine(
        loaded,
        index,
        FAMILIES[index.family],
        renderer,
        model_id=settings.model_id,
        max_prompt_tokens=settings.max_prompt_tokens,
    )
    running.servicer.engine = engine
    running.set_serving(True)
    log.info("ar_service ready on %s:%d (model %s, renderer at %s)", settings.host, running.port, engine.model_id, settings.dit_address)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.set_serving(False)
    running.server.stop(grace=5).wait()
    engine.close()
    renderer.close()


if __name__ == "__main__":
    sys.exit(main())
