"""Graceful stop of a gRPC service on SIGTERM / SIGINT.

1. report NOT_SERVING on grpc.health.v1 (load balancers and probes stop sending new work),
2. keep accepting for ``drain_s`` seconds (time for them to notice; 0 by default),
3. ``server.stop(grace_s)``: refuse new calls, let in-flight ones finish for up to ``grace_s`` seconds,
   then cancel what is left (the RPC callbacks cancel the engine's jobs),
4. return, so that the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import grpc

log = logging.getLogger("servicekit.lifecycle")


def install_stop_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (install before loading the model: a stop while loading is honoured)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def stop_gracefully(
    name: str,
    server: grpc.Server,
    set_serving: Callable[[bool], None],
    drain_s: float,
    grace_s: float,
) -> None:
    set_serving(False)
    log.info("%s stopping: NOT_SERVING, draining %.1f s, then %.1f s grace for in-flight calls", name, drain_s, grace_s)
    if drain_s > 0:
        time.sleep(drain_s)
    started = time.monotonic()
    server.stop(grace=grace_s).wait()
    log.info("%s stopped after %.1f s", name, time.monotonic() - started)


def abort_start(name: str, server: grpc.Server) -> NoReturn:
    """A start that failed after the server began listening (loading, warm-up: e.g. out of GPU memory while
    capturing graphs): logs why, stops the server and exits 1 without interpreter teardown, so that no thread the
    failed start left behind keeps the process alive, listening and never serving. Call it from an except block."""
    logging.getLogger(name).exception("%s could not start", name)
    server.stop(0)
    exit_process(1)


def exit_process(code: int = 0) -> NoReturn:
    """Ends the process once the server has stopped: flushes the logs and exits without interpreter teardown.

    Daemon threads (the engine's worker, gRPC's pollers, torch's pools) may still exist; tearing the
    interpreter down under them can abort the process ("terminate called without an active exception",
    exit -6) although everything was already stopped cleanly. The exit code must say what happened.
    """
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
