"""``python -m bench.fuzz --cases 1000``: schema-driven fuzzing of the gateway's REST API, at length.

Starts a private stack of the three real services on loopback (the tiny model, written to a temporary
directory) unless ``--url`` points at a running gateway, lets the gateway's own OpenAPI document drive
schemathesis over every route (tools/api_fuzz.py), and prints the case count, the statuses seen and
every finding (a 5xx, or an answer the document does not describe). Exit code 1 when anything was found.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tools.api_fuzz import fuzz


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="cases to generate and send (default 1000)")
    parser.add_argument("--url", help="fuzz a running gateway instead of starting a private stack")
    parser.add_argument("--api-key", help="API key to send (Authorization: Bearer)")
    parser.add_argument("--model-dir", type=Path, help="pipeline directory (default: a fresh tiny model)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0; -1 for a random run)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    seed = None if args.seed < 0 else args.seed

    with tempfile.TemporaryDirectory(prefix="ardit-fuzz-") as workdir:
        stack = None
        url = args.url
        if url is None:
            from tools.local_stack import LocalStack
            from tools.make_tiny import make_tiny

            model_dir = args.model_dir
            if model_dir is None:
                model_dir = Path(workdir) / "tiny"
                make_tiny(model_dir)
            stack = LocalStack(model_dir, Path(workdir) / "logs")
            print(f"starting a private stack on the model in {model_dir} ...", flush=True)
            stack.up()
            url = stack.gateway_url
        try:
            started = time.monotonic()
            print(f"fuzzing {url} with {args.cases} cases", flush=True)
            report = fuzz(url, args.cases, headers=headers, timeout=args.timeout, seed=seed,
                          log=lambda line: print(line, flush=True))
            print(f"\n== bench.fuzz: {url}, {time.monotonic() - started:.0f} s ==")
            print(report.summary())
            for finding in report.findings[:20]:
                print(f"- {finding.operation} -> {finding.status} [{finding.check}] {finding.detail[:500]}\n  body: {finding.body!r:.300}")
        finally:
            if stack is not None:
                codes = stack.down()
                print(f"services stopped: {codes}")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
