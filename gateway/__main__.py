"""``python -m gateway [--help]``: serve the OpenAI-compatible REST API with uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings
from servicekit import tracing
from servicekit.logs import setup_logging
from servicekit.ports import refuse_busy_ports
from servicekit.settings import load_settings

log = logging.getLogger("gateway")


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(
        GatewaySettings,
        argv,
        prog="python -m gateway",
        description="ardit's OpenAI-compatible REST gateway in front of ar_service and dit_service.",
    )
    setup_logging(settings.log_level)
    refuse_busy_ports("gateway", settings.host, settings.port)  # uvicorn would start the app first, then fail noisily
    tracing.setup("gateway")  # off unless the OTEL_* environment asks for it
    app = create_app(settings)
    log.info("gateway on http://%s:%d -> ar %s, dit %s", settings.host, settings.port, settings.ar_address, settings.dit_address)
    try:
        # log_config=None keeps the ardit log format; access_log off: the app logs one line per request.
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                    log_config=None, access_log=False)
    except KeyboardInterrupt:
        pass  # uvicorn already shut down gracefully; Ctrl-C is a normal way to stop
    log.info("gateway stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
