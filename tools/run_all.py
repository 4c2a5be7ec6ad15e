"""Starts dit_service, ar_service and the gateway on localhost in the foreground, and keeps them up.

Used by ``make up``. It behaves like compose's ``restart: unless-stopped``: a service that exits is started
again after a short backoff (1 s, doubling up to 16 s) while the other two keep running; a service that
exits ``--max-crashes`` times within ``--crash-window-s`` seconds is given up on, and then all three stop
(exit code 1). Ctrl-C (or SIGTERM) stops all three (exit code 0). Each service reads its own settings
(flags, ARDIT_* environment, YAML); this tool only passes the ports and the model directory.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 16.0
STOP_TIMEOUT_S = 10.0
#: What `make up` serves: the trained Dev shapes model, which draws and edits (Makefile MODEL_DIR), also when this
#: tool runs alone.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "train" / "checkpoints" / "shapes-dev"
#: What `make up` lets OpenAI clients call the served model: every image model name OpenAI's API reference and its
#: SDK list (openai-python 3.63, openai/types/image_model.py: ImageModel), since a client sends one of them when
#: nobody set a model (Open WebUI and LangChain: dall-e-2; LibreChat's image tool: gpt-image-1; newer clients a
#: gpt-image-2 model). compose.yaml's ARDIT_MODEL_ALIASES default names the same.
DEFAULT_ALIASES = (
    "dall-e-2",
    "dall-e-3",
    "gpt-image-1",
    "gpt-image-1-mini",
    "gpt-image-1.5",
    "gpt-image-2",
    "gpt-image-2-2026-04-21",
    "gpt-image-2.5-sunburst",
    "gpt-image-2.5-sunburst-2026-09-08",
    "gpt-image-2.5-flare",
    "gpt-image-2.5-flare-2026-09-08",
    "gpt-image-2.6-sunburst",
    "gpt-image-2.6-flare",
    "chatgpt-image-latest",
)


class RestartPolicy:
    """When to start a service again after it exited: backoff doubling per recent exit, or give up."""

    def __init__(self, max_crashes: int, window_s: float):
        self.max_crashes = max_crashes
        self.window_s = window_s
        self.exits: deque[float] = deque()

    def after_exit(self, now: float) -> float | None:
        """Seconds to wait before the restart, or None: too many exits within the window, give up."""
        self.exits.append(now)
        while self.exits and self.exits[0] < now - self.window_s:
            self.exits.popleft()
        if len(self.exits) >= self.max_crashes:
            return None
        return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(self.exits) - 1))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Service:
    """One child process under ``restart: unless-stopped``."""

    def __init__(self, name: str, args: list[str], policy: RestartPolicy):
        self.name = name
        self.command = [sys.executable, "-m", name, *args]
        self.policy = policy
        self.process: subprocess.Popen | None = None
        self.restart_at: float | None = None  # set while waiting out the backoff

    def start(self) -> None:
        self.process = subprocess.Popen(self.command)
        self.restart_at = None
        say(f"{self.name} started (pid {self.process.pid})")

    def check(self, now: float) -> bool:
        """Restarts the service when it is due; returns False when the service is given up on."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start()
            return True
        assert self.process is not None
        code = self.process.poll()
        if code is None:
            return True
        delay = self.policy.after_exit(now)
        if delay is None:
            say(
                f"{self.name} {describe_exit(code)}: {self.policy.max_crashes} exits within {self.policy.window_s:g} s; "
                "giving up and stopping everything"
            )
            return False
        say(f"{self.name} {describe_exit(code)}; restarting it in {delay:g} s (the others keep running)")
        self.restart_at = now + delay
        return True

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop within {STOP_TIMEOUT_S:g} s; killing it")
            self.process.kill()
            self.process.wait()


def say(message: str) -> None:
    print(f"ardit: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.run_all", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
        help="pipeline directory (default: train/checkpoints/shapes-dev, the Dev shapes model `make up` serves)",
    )
    parser.add_argument("--gateway-port", type=int, default=8000, help="HTTP port of the gateway (default: 8000)")
    parser.add_argument("--ar-port", type=int, default=50051, help="gRPC port of ar_service (default: 50051)")
    parser.add_argument("--dit-port", type=int, default=50052, help="gRPC port of dit_service (default: 50052)")
    parser.add_argument(
        "--model-aliases", default=",".join(DEFAULT_ALIASES), metavar="NAMES",
        help="comma-separated model names the gateway also accepts for the served model (the model directory's name), "
        "for OpenAI clients that send one unasked; '' for none (default: %(default)s)",
    )
    parser.add_argument("--max-crashes", type=int, default=5, help="give up after this many exits of one service ... (default: 5)")
    parser.add_argument("--crash-window-s", type=float, default=60.0, help="... within this many seconds (default: 60)")
    args = parser.parse_args(argv)
    if args.max_crashes < 1 or args.crash_window_s <= 0:
        parser.error("--max-crashes must be at least 1 and --crash-window-s positive")

    ar, dit = f"127.0.0.1:{args.ar_port}", f"127.0.0.1:{args.dit_port}"
    served = args.model_dir.resolve().name
    aliases = [name.strip() for name in args.model_aliases.split(",") if name.strip()]
    gateway_aliases = ["--model-aliases", ",".join(f"{name}={served}" for name in aliases)] if aliases else []
    commands = {
        "dit_service": ["--port", str(args.dit_port), "--model-dir", str(args.model_dir)],
        "ar_service": ["--port", str(args.ar_port), "--model-dir", str(args.model_dir), "--dit-address", dit],
        "gateway": ["--port", str(args.gateway_port), "--ar-address", ar, "--dit-address", dit, *gateway_aliases],
    }
    services = [Service(name, command, RestartPolicy(args.max_crashes, args.crash_window_s)) for name, command in commands.items()]

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for service in services:
        service.start()
    say(
        f"gateway on http://127.0.0.1:{args.gateway_port} (ar_service {ar}, dit_service {dit}); "
        "a service that exits is restarted; Ctrl-C stops all three"
    )
    if aliases:
        say(f"model {served} also answers to {', '.join(aliases)} (--model-aliases)")
    exit_code = 0
    while not stopping:
        now = time.monotonic()
        if not all(service.check(now) for service in services):
            exit_code = 1
            break
        time.sleep(0.2)
    for service in services:
        service.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for service in services:
        service.wait(deadline)
    say("stopped")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
