"""Starts dit_service, ar_service and the gateway on localhost in the foreground.

Used by ``make up``. Ctrl-C (or SIGTERM, or any one service exiting) stops all three.
Each service reads its own settings (flags, ARDIT_* environment, YAML); this tool only
passes the model directory to the two model services.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

SERVICES = (
    ("dit_service", ["-m", "dit_service"], True),
    ("ar_service", ["-m", "ar_service"], True),
    ("gateway", ["-m", "gateway"], False),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.run_all", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny"), help="pipeline directory (default: models/tiny)")
    args = parser.parse_args(argv)

    processes: list[tuple[str, subprocess.Popen]] = []
    for name, command, takes_model in SERVICES:
        extra = ["--model-dir", str(args.model_dir)] if takes_model else []
        processes.append((name, subprocess.Popen([sys.executable, *command, *extra])))
    print("ardit: gateway on http://127.0.0.1:8000 (ar_service :50051, dit_service :50052); Ctrl-C stops all", flush=True)

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    exit_code = 0
    while not stopping:
        for name, process in processes:
            if process.poll() is not None:
                print(f"ardit: {name} exited with code {process.returncode}; stopping the others", flush=True)
                exit_code = process.returncode or 1
                stopping = True
                break
        time.sleep(0.2)
    for _, process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for _, process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
