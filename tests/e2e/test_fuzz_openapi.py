"""The gateway's OpenAPI document drives schemathesis over every route of the real stack (bounded run).

No 5xx and no answer that breaks the document (status, content type, headers, body). The long run
(>= 1,000 cases) is ``python -m bench.fuzz``; this one keeps CI fast.
"""

from __future__ import annotations

import os

from tools.api_fuzz import fuzz

CASES = int(os.environ.get("ARDIT_FUZZ_CASES", "150"))


def test_schema_driven_fuzzing_finds_no_5xx_and_no_schema_violation(stack):
    report = fuzz(stack.gateway_url, CASES, timeout=120, seed=0, log=lambda *_: None)
    print(report.summary())
    assert report.cases >= CASES * 0.9
    assert report.server_errors == 0, report.summary()
    assert report.findings == [], report.summary()
