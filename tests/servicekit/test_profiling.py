"""servicekit.profiling: a trace per busy period, a shared no-op when off, a cap on the trace count."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ar_service.settings import ARSettings
from dit_service.settings import DiTSettings
from servicekit.profiling import BusyProfiler, make_profiler, stage, trace_event_names
from servicekit.settings import load_settings


def test_off_is_no_profiler_and_a_shared_null_context(tmp_path):
    assert make_profiler("ar_service", None, "cpu") is None
    first, second = stage(None, "ar.prefill"), stage(None, "ar.sample")
    assert isinstance(first, contextlib.nullcontext) and first is second  # nothing allocated per stage
    assert not list(tmp_path.iterdir())


def test_idle_profiler_labels_nothing(tmp_path):
    profiler = BusyProfiler("svc", tmp_path)
    assert isinstance(profiler.stage("x"), contextlib.nullcontext)
    assert profiler.idle() is None  # idle without a busy period writes nothing
    assert not list(tmp_path.iterdir())


def test_busy_period_writes_one_trace_with_its_stages(tmp_path):
    profiler = make_profiler("svc", tmp_path / "traces", "cpu")
    assert profiler is not None and not profiler.cuda
    profiler.busy("req-1/../odd id")
    profiler.busy("req-2")  # already recording: the first request names the trace
    with profiler.stage("svc.work"):
        torch.ones(8, 8) @ torch.ones(8, 8)
    path = profiler.idle()
    assert path is not None and path.parent == tmp_path / "traces"
    assert path.name.startswith("svc-") and path.name.endswith("-req-1_.._odd_id.json")
    assert "svc.work" in trace_event_names(path)
    assert profiler.traces() == [path] and not profiler.recording
    assert list((tmp_path / "traces").iterdir()) == [path]  # written under another name, then renamed: nothing left


def test_trace_cap(tmp_path):
    profiler = BusyProfiler("svc", tmp_path, max_traces=2)
    for i in range(4):
        profiler.busy(f"r{i}")
        with profiler.stage("svc.work"):
            torch.zeros(2).sum()
        profiler.idle()
    assert len(list(tmp_path.glob("svc-*.json"))) == 2
    assert profiler.exhausted and not profiler.recording
    assert isinstance(profiler.stage("svc.work"), contextlib.nullcontext)


def test_cap_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        BusyProfiler("svc", tmp_path, max_traces=0)


@pytest.mark.parametrize("cls, prefix", [(ARSettings, "ARDIT_AR_"), (DiTSettings, "ARDIT_DIT_")])
def test_settings_default_off_and_set_by_flag_or_environment(cls, prefix, tmp_path, monkeypatch):
    for name in ("PROFILE_DIR", "PROFILE_MAX_TRACES", "CONFIG"):
        monkeypatch.delenv(prefix + name, raising=False)
    settings = load_settings(cls, [])
    assert settings.profile_dir is None and settings.profile_max_traces == 10
    flagged = load_settings(cls, ["--profile-dir", str(tmp_path), "--profile-max-traces", "3"])
    assert flagged.profile_dir == tmp_path and flagged.profile_max_traces == 3
    monkeypatch.setenv(prefix + "PROFILE_DIR", str(tmp_path / "env"))
    assert load_settings(cls, []).profile_dir == tmp_path / "env"
