"""``python -m dit_service``: load the DiT stack and serve Render over gRPC."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from dit_service.settings import DiTSettings
from servicekit.logs import setup_logging
from servicekit.settings import load_settings

log = logging.getLogger("dit_service")


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(DiTSettings, argv, prog="python -m dit_service", description="ardit's DiT rendering service")
    setup_logging(settings.log_level)

    from dit_service.engine import DiTEngine
    from dit_service.model.pipeline import DiTPipeline
    from dit_service.server import build_server
    from protos.knobs import FAMILIES
    from servicekit.devices import pick_device, pick_dtype
    from servicekit.model_index import read_model_index

    index = read_model_index(settings.model_dir)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    running = build_server(settings.host, settings.port, settings.max_workers)
    running.server.start()
    log.info("dit_service listening on %s:%d, loading %s on %s (%s)", settings.host, running.port, index.root, device, dtype)
    try:
        pipeline = DiTPipeline.from_directory(index.root, device=device, dtype=dtype)
    except BaseException:
        running.server.stop(0)
        raise
    engine = DiTEngine(pipeline, FAMILIES[index.family], settings.max_condition_positions)
    running.servicer.engine = engine
    running.set_serving(True)
    log.info("dit_service ready on %s:%d", settings.host, running.port)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.set_serving(False)
    running.server.stop(grace=5).wait()
    engine.close()


if __name__ == "__main__":
    sys.exit(main())
