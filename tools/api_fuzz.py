"""Schema-driven fuzzing of the gateway: its own OpenAPI document drives schemathesis over every route.

``fuzz(base_url, cases)`` loads ``/openapi.json`` from a running gateway, and for each operation draws
cases (schema-valid and schema-invalid, alternating) with hypothesis, sends them over HTTP and runs
schemathesis' checks on each answer: no 5xx, status codes, content types, headers and bodies as the
document says, schema-invalid input refused. Findings are collected, not raised, so that one run counts
them all. Used by ``tests/e2e/test_fuzz_openapi.py`` (a bounded run) and ``python -m bench.fuzz``.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Finding:
    operation: str
    status: int | None
    check: str
    detail: str
    body: Any


@dataclass
class FuzzReport:
    cases: int = 0
    seconds: float = 0.0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    per_operation: collections.Counter = field(default_factory=collections.Counter)
    findings: list[Finding] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if isinstance(status, int) and status >= 500)

    def summary(self) -> str:
        lines = [
            f"cases: {self.cases} in {self.seconds:.0f} s",
            "per operation: " + ", ".join(f"{op} {n}" for op, n in sorted(self.per_operation.items())),
            "statuses: " + ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items(), key=lambda i: str(i[0]))),
            f"5xx responses: {self.server_errors}",
            f"findings: {len(self.findings)}",
        ]
        kinds = collections.Counter((f.operation, f.check) for f in self.findings)
        for (operation, check), count in kinds.most_common():
            example = next(f for f in self.findings if (f.operation, f.check) == (operation, check))
            lines.append(f"  {count} x {check} on {operation} (e.g. status {example.status}: {example.detail[:300]})")
        return "\n".join(lines)


def _checks():
    from schemathesis import checks as core_checks
    from schemathesis.specs.openapi import checks as openapi_checks

    chosen = [core_checks.not_a_server_error]
    for name in (
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
    ):
        check = getattr(openapi_checks, name, None)
        if check is not None:
            chosen.append(check)
    return chosen


def _failures(exc: BaseException) -> list[tuple[str, str]]:
    inner = getattr(exc, "exceptions", None)
    if inner:
        out = []
        for item in inner:
            out += _failures(item)
        return out
    title = getattr(exc, "title", None) or type(exc).__name__
    message = getattr(exc, "message", None) or str(exc)
    return [(str(title), str(message))]


def fuzz(
    base_url: str,
    cases: int,
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
    seed: int | None = 0,
    log=print,
) -> FuzzReport:
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase
    from schemathesis import GenerationMode

    headers = dict(headers or {})
    document = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    checks = _checks()
    report = FuzzReport()
    started = time.monotonic()
    # The cheap routes get a tenth of the budget each (a route without inputs has a single case);
    # the image route, last, gets whatever is left, half schema-valid and half schema-invalid.
    operations.sort(key=lambda op: "images" in op.path)

    def case_runner(operation, wanted: int):
        """The body of one hypothesis test: calls ``operation`` for at most ``wanted`` cases and records each."""
        done = 0

        def run(case) -> None:
            nonlocal done
            if done >= wanted:
                return
            done += 1
            report.cases += 1
            report.per_operation[operation.label] += 1
            try:
                response = case.call(base_url=base_url, headers=headers, timeout=timeout)
            except Exception as exc:  # transport error: the gateway did not answer at all
                report.statuses["no answer"] += 1
                report.findings.append(Finding(operation.label, None, "no answer", repr(exc)[:500], case.body))
                return
            report.statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=checks)
            except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup is a BaseExceptionGroup
                for check, detail in _failures(exc):
                    report.findings.append(Finding(operation.label, response.status_code, check, detail, case.body))
            if report.cases % 100 == 0:
                log(f"  ... {report.cases} cases, {len(report.findings)} findings, {time.monotonic() - started:.0f} s")

        return run

    for position, operation in enumerate(operations):
        last = position == len(operations) - 1
        share = cases - report.cases if last else max(1, cases // 10)
        first_count = report.cases
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            spent = report.cases - first_count
            wanted = (share + 1) // 2 if mode is GenerationMode.POSITIVE else share - spent
            if wanted <= 0:
                continue
            run = case_runner(operation, wanted)
            strategy = operation.as_strategy(generation_mode=mode)
            test = hypothesis.given(case=strategy)(run)
            test = hypothesis.settings(
                max_examples=wanted * 3,  # hypothesis discards duplicates; `run` stops counting at `wanted`
                deadline=None,
                derandomize=seed is not None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(test)
            if seed is not None:
                test = hypothesis.seed(seed)(test)
            try:
                test()
            except hypothesis.errors.Unsatisfiable:
                pass
    report.seconds = time.monotonic() - started
    return report
