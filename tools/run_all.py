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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.run_all", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny"), help="pipeline directory (default: models/tiny)")
    parser.add_argument("--gateway-port", type=int, default=8000, help="HTTP port of the gateway (default: 8000)")
    parser.add_argument("--ar-port", type=int, default=50051, help="gRPC port of ar_service (default: 50051)")
    parser.add_argument("--dit-port", type=int, default=50052, help="gRPC port of dit_service (default: 50052)")
    args = parser.parse_args(argv)

    ar, dit = f"127.0.0.1:{args.ar_port}", f"127.0.0.1:{args.dit_port}"
    commands = {
        "dit_service": ["dit_service", "--port", str(args.dit_port), "--model-dir", str(args.model_dir)],
        "ar_service": ["ar_service", "--port", str(args.ar_port), "--model-dir", str(args.model_dir), "--dit-address", dit],
        "gateway": ["gateway", "--port", str(args.gateway_port), "--ar-address", ar, "--dit-address", dit],
    }
    processes = [(name, subprocess.Popen([sys.executable, "-m", *command])) for name, command in commands.items()]
    print(
        f"ardit: gateway on http://127.0.0.1:{args.gateway_port} (ar_service {ar}, dit_service {dit}); "
        "Ctrl-C stops all three",
        flush=True,
    )

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
