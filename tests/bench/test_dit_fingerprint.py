"""bench.dit_fingerprint on the tiny DiT (CPU): the same build gives the same digests run after run, so a difference
between two builds is a difference in their arithmetic; other weights give other digests."""

from __future__ import annotations

import json

import torch

from bench import dit_fingerprint


def test_a_build_fingerprints_the_same_twice_and_other_weights_differ(tmp_path):
    out = tmp_path / "fingerprint.json"
    assert dit_fingerprint.main(["--tiny", "--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    again = dit_fingerprint.fingerprint(True, torch.device("cpu"), repeats=2)
    assert (first["velocity_digest"], first["render"]["pixels_digest"]) == (
        again["velocity_digest"], again["render"]["pixels_digest"])
    assert first["code"].endswith("dit_service") and first["render"]["steps"] == 4
    assert len(again["step_ms"]) == 2 and all(ms > 0 for round_ in again["step_ms"] for ms in round_.values())
    other = dit_fingerprint.fingerprint(True, torch.device("cpu"), repeats=1, seed=1)
    assert other["velocity_digest"] != first["velocity_digest"]
    assert other["render"]["pixels_digest"] != first["render"]["pixels_digest"]
