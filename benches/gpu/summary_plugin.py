"""pytest plugin of benches/gpu/run.sh: one line per test in summary.md the moment it finishes.

    SUMMARY=$OUT/summary.md python -m pytest -p summary_plugin ...   (benches/gpu on PYTHONPATH)

Each line: ✓ (passed), ✗ (failed or error; the first line of the error follows) or – (skipped,
with the reason), the test's id, its ``figure`` property (tests/python/test_gpu_*.py record one
per check) and its seconds. A collection error is a ✗ line of its own, so one broken file cannot
hide the others (run.sh passes --continue-on-collection-errors). The id of the test running is
kept in $SUMMARY.current, so a step killed by its timeout can say which test it was in.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

_reports: Dict[str, List[Any]] = {}
_counts = {"✓": 0, "✗": 0, "–": 0}


def _path() -> str:
    return os.environ.get("SUMMARY", "")


def _write(line: str) -> None:
    path = _path()
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _message(report: Any, collecting: bool = False) -> str:
    """The error in one line: pytest prints the exception's own lines as "E ..."; a failed test's
    first one is its assertion message, a failed import's last one names the error (after the
    file and line, for a syntax error)."""
    text = str(getattr(report, "longreprtext", "") or report.longrepr or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    e_lines = [ln[2:].strip() for ln in lines if ln.startswith("E ")]
    if not e_lines:
        return (lines[-1] if lines else "failed")[:300]
    if not collecting:
        return e_lines[0][:300]
    where = e_lines[0] if e_lines[0].startswith("File ") and len(e_lines) > 1 else ""
    return (e_lines[-1] + (f" ({where})" if where else ""))[:300]


def _skip_reason(report: Any) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr or "skipped")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    path = _path()
    if path:
        with open(path + ".current", "w", encoding="utf-8") as f:
            f.write(nodeid + "\n")


def pytest_runtest_logreport(report: Any) -> None:
    _reports.setdefault(report.nodeid, []).append(report)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    reports = _reports.pop(nodeid, [])
    seconds = sum(r.duration for r in reports)
    name = nodeid.split("::", 1)[-1]
    figure = ""
    for r in reports:
        for k, v in r.user_properties:
            if k == "figure":
                figure = str(v)
    failed = [r for r in reports if r.failed]
    skipped = [r for r in reports if r.skipped]
    if failed:
        mark = "✗"
        when = "" if failed[0].when == "call" else f" (in {failed[0].when})"
        detail = f"{figure + '; ' if figure else ''}{_message(failed[0])}{when}"
    elif skipped:
        mark, detail = "–", f"skipped: {_skip_reason(skipped[0])}"
    else:
        mark, detail = "✓", figure
    _counts[mark] += 1
    _write(f"- {mark} `{name}` — {detail} ({seconds:.1f} s)" if detail
           else f"- {mark} `{name}` ({seconds:.1f} s)")
    path = _path()
    if path and os.path.exists(path + ".current"):
        os.remove(path + ".current")


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _counts["✗"] += 1
        _write(f"- ✗ collecting `{report.nodeid}` — {_message(report, collecting=True)}")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    c = _counts
    _write(f"- tests: {c['✓']} passed, {c['✗']} failed, {c['–']} skipped")
