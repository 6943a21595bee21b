"""The run report is drawn in a child process (matplotlib holds the GIL for long stretches: in a
thread of the controller it stalled the app's event loop), with a clear error when that fails."""

from __future__ import annotations

import json
import os

import anyio
import pytest

from asyncrl.pipelines.observe import report
from asyncrl.pipelines.observe.trace import Span

HISTORY = [{"step": 0, "reward/mean": 0.25}, {"step": 1, "reward/mean": float("nan")}]
SPANS = [Span("generate", "rollout", 0.0, 2.0, arrived=0.5, ran=(1.0, 2.0)), Span("update", "actor", 2.0, 3.0),
         Span("fit", "controller", 0.0, 3.0)]
EVALS = [{"eval/version": 0, "eval/accuracy_flexible": 0.5, "step": 0}]


def test_the_child_reads_what_the_spans_and_metrics_say():
    data = report._plain(HISTORY, SPANS, EVALS)
    assert data == {
        "history": [{"step": 0, "reward/mean": 0.25}, {"step": 1, "reward/mean": None}],  # NaN: not JSON
        "evals": [{"eval/version": 0, "eval/accuracy_flexible": 0.5}],
        "spans": [{"track": "rollout", "name": "generate", "parts": [["queued", 0.0, 0.5], ["waiting", 0.5, 1.0],
                                                                      ["exec", 1.0, 2.0]]},
                  {"track": "actor", "name": "update", "parts": [["call", 2.0, 3.0]]},
                  {"track": "controller", "name": "fit", "parts": [["call", 0.0, 3.0]]}],
    }
    json.dumps(data, allow_nan=False)


async def test_draw_report_writes_the_png_from_a_child_process_and_cleans_up(tmp_path):
    out = await report.draw_report(HISTORY, SPANS, tmp_path / "r" / "report.png", evals=EVALS)
    assert out == tmp_path / "r" / "report.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "r") == ["report.png"]  # the data file is gone


async def test_a_failing_child_is_a_report_error_naming_its_exit_status(tmp_path):
    (tmp_path / "report.png").mkdir()  # savefig cannot write a file where a directory is
    with pytest.raises(report.ReportError, match=r"drawing the report .*report\.png failed \(exit status 1\)"):
        await report.draw_report(HISTORY, SPANS, tmp_path / "report.png")
    assert os.listdir(tmp_path) == ["report.png"]


HANG = "import os, sys, time\nopen(sys.argv[2] + '.pid', 'w').write(str(os.getpid()))\nwhile True: time.sleep(1)\n"
"""A drawing script that never finishes (it first writes its pid beside the PNG's path)."""


async def test_a_child_past_its_deadline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(report._report_draw, "__file__", str(tmp_path / "hang.py"))
    (tmp_path / "hang.py").write_text(HANG)
    with pytest.raises(report.ReportError, match=r"took over 0.3 s; the drawing process was killed"):
        await report.draw_report(HISTORY, SPANS, tmp_path / "report.png", timeout_s=0.3)


async def test_cancelling_the_report_kills_its_child(tmp_path, monkeypatch):
    monkeypatch.setattr(report._report_draw, "__file__", str(tmp_path / "hang.py"))
    (tmp_path / "hang.py").write_text(HANG)
    pid_file = tmp_path / "report.png.pid"
    async with anyio.create_task_group() as tg:
        tg.start_soon(report.draw_report, HISTORY, SPANS, tmp_path / "report.png")
        with anyio.fail_after(60):
            while not pid_file.exists() or not pid_file.read_text():
                await anyio.sleep(0.01)  # poll until the child runs (bounded by the deadline)
        tg.cancel_scope.cancel()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # killed and reaped
    assert sorted(os.listdir(tmp_path)) == ["hang.py", "report.png.pid"]  # the data file is gone
