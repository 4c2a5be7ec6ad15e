"""--profile-dir on real services: one request leaves one Chrome trace per model service, holding its stages."""

from __future__ import annotations

import time

from servicekit.profiling import trace_event_names
from tools.local_stack import LocalStack


def test_one_request_writes_a_trace_per_service(tiny_model, tmp_path):
    traces = tmp_path / "traces"
    stack = LocalStack(
        tiny_model,
        tmp_path / "logs",
        extra={"ar_service": ["--profile-dir", str(traces)]},
        env={"ARDIT_DIT_PROFILE_DIR": str(traces)},  # the environment variable works as the flag does
    )
    stack.up()
    try:
        response = stack.generate({"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 2, "seed": 9})
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # each service writes its trace, then logs where
            found = {name: sorted(traces.glob(f"{name}-*.json")) for name in ("ar_service", "dit_service")}
            if all(found.values()) and all("profiler trace written to" in stack.log_text(name) for name in found):
                break
            time.sleep(0.1)
    finally:
        codes = stack.down()
    assert codes["dit_service"] == codes["ar_service"] == 0, codes
    assert len(found["ar_service"]) == len(found["dit_service"]) == 1, found
    ar, dit = found["ar_service"][0], found["dit_service"][0]
    # <service>-<UTC time>-<request id>.json: the DiT renders under the AR's request id
    assert ar.name.split("-", 2)[2] == dit.name.split("-", 2)[2]
    assert {"ar.prefill", "ar.decode_step", "ar.sample"} <= trace_event_names(ar)
    # the worker's stages; images are encoded beside it, on encoder threads (encode_ms, the dit.encode span)
    assert {"dit.denoise_step", "dit.vae_decode"} <= trace_event_names(dit)
    assert f"profiler trace written to {ar}" in stack.log_text("ar_service")
    assert f"profiler trace written to {dit}" in stack.log_text("dit_service")
