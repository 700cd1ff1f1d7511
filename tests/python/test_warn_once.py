"""Every guardrail was once printed twice (a RuntimeWarning and a log line). ``warn_once`` says
it once: as a warning, or on the ``spillover`` logger when the warnings filters ignore it."""

from __future__ import annotations

import logging
import warnings

from conftest import gpt_step

import spillover
from spillover import _runtime

MiB = 1 << 20


def test_warn_once_is_one_warning_or_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(_runtime, "_warned", set())
    caplog.set_level(logging.WARNING, logger="spillover")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _runtime.warn_once("issue20-a", "spillover: shown as a warning")
        _runtime.warn_once("issue20-a", "spillover: shown as a warning")
    assert [str(w.message) for w in record] == ["spillover: shown as a warning"]
    assert record[0].category is RuntimeWarning
    assert not [r for r in caplog.records if "shown as a warning" in r.getMessage()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="spillover: filtered")
        _runtime.warn_once("issue20-b", "spillover: filtered, so logged")
    assert not record
    assert [r.getMessage() for r in caplog.records
            if "filtered" in r.getMessage()] == ["spillover: filtered, so logged"]


def test_a_guardrail_prints_once(caplog, monkeypatch, tiny_gpt, private_pool_bytes):
    monkeypatch.setattr(_runtime, "_warned", set())
    caplog.set_level(logging.WARNING, logger="spillover")
    model, batch = tiny_gpt
    ctx = spillover.offload_context("host", min_offload_bytes=0,
                                    host_pool_bytes=MiB + private_pool_bytes % (1 << 16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gpt_step(model, batch, ctx)
    shown = [str(w.message) for w in record if "host pool was full" in str(w.message)]
    logged = [r for r in caplog.records if "host pool was full" in r.getMessage()]
    assert len(shown) + len(logged) == 1, (shown, logged)
