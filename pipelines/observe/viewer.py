"""``asyncrl view``: one page for one or more runs (metric curves, the overlap timeline, the
sampled trajectories), served live or written as one self-contained file.

::

    run dirs ─► load_run (metrics.jsonl, samples.jsonl, trace.json, journal.jsonl) ─► JSON
      ├─ --out FILE.html: the page with its scripts and the JSON inlined (works offline)
      └─ serve: ThreadingHTTPServer on loopback; GET /  the page, GET /api/data?have=[...] the JSON
         (what the page lacks: RunFollower reads only the lines appended since; the page polls every
         2 s, so a live run updates)

The page (``viewer_static/view.html``) draws with the vendored uPlot and plain SVG and renders
every piece of model output with ``textContent``: a response is untrusted text. Inlined JSON
escapes ``<``, so no text can close the ``<script>`` element that carries it.
"""

from __future__ import annotations

import http.server
import json
import math
import os
import re
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qs, urlparse

from asyncrl.pipelines.observe.metrics import jsonl_lines

__all__ = ["RunError", "RUN_FILES", "describe", "load_run", "load_runs", "make_server", "render_html", "serve", "RunFollower"]

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "trace.json", "journal.jsonl")
"""The files of a run directory the viewer reads (any one makes a directory a run)."""

MAX_SPANS = 50_000
"""Spans drawn of one run's trace (the last ones when there are more)."""


class RunError(ValueError):
    """Raised when a path given to ``asyncrl view`` is not a run directory."""


def _finished(run: Path) -> bool:
    """Whether the run ended: its journal's last record is ``end`` (or, without a journal, trace.json exists)."""
    j = run / "journal.jsonl"
    if j.exists():
        with j.open("rb") as f:
            f.seek(max(0, j.stat().st_size - 4096))
            tail = jsonl_lines(f.read().decode("utf-8", "replace"))
        for line in reversed(tail):
            try:
                return json.loads(line).get("kind") == "end"
            except (ValueError, AttributeError):
                continue
        return False
    return (run / "trace.json").exists()


def _spans(trace: Path) -> dict[str, Any]:
    """The trace's spans: ``{"tracks": [name per track], "spans": [[track, name, start_s, dur_s, wait]]}``."""
    try:
        events = json.loads(trace.read_text(encoding="utf-8", errors="replace")).get("traceEvents", [])
    except (OSError, ValueError, AttributeError, RecursionError):
        return {"tracks": [], "spans": [], "error": f"{trace.name} is unreadable"}
    procs = {e["pid"]: str(e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): str(e["args"]["name"]) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    xs = [e for e in events if e.get("ph") == "X"]
    xs.sort(key=lambda e: e.get("ts", 0))
    xs = xs[-MAX_SPANS:]
    keys = sorted({(e["pid"], e["tid"]) for e in xs})
    track = {k: i for i, k in enumerate(keys)}
    names = [f"{procs.get(p, p)} · {threads.get((p, t), f'lane {t}')}" for p, t in keys]
    spans = [[track[(e["pid"], e["tid"])], str(e.get("name", "")), e.get("ts", 0) / 1e6, e.get("dur", 0) / 1e6,
              1 if e.get("cat") == "wait" else 0] for e in xs]
    return {"tracks": names, "spans": spans}


_SURROGATE = re.compile("[\ud800-\udfff]")


def _clean(v: Any) -> Any:
    """`v` (a parsed JSON value) as the page can hold it: NaN and infinities become null (JSON has none), lone
    surrogates (JSON escapes may spell them, UTF-8 cannot) become U+FFFD."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        return _SURROGATE.sub("\ufffd", v)
    if isinstance(v, list):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {_clean(str(k)): _clean(x) for k, x in v.items()}
    return v


def _is_sample(row: dict[str, Any]) -> bool:
    """Whether `row` is a trajectory the page can draw: an integer step and token columns of one length (a
    row that is not is skipped and counted, never drawn half)."""
    t, step = row.get("tokens"), row.get("step")
    if not isinstance(t, dict) or not isinstance(step, int) or isinstance(step, bool):
        return False
    ids = t.get("id")
    if not isinstance(ids, list):
        return False
    columns = [t.get(k) for k in ("text", "mask", "version", "advantage")]
    optional = [t.get(k) for k in ("logp_rollout", "logp_old") if t.get(k) is not None]
    return all(isinstance(c, list) and len(c) == len(ids) for c in columns + optional)


def _count(have: dict[str, Any], key: str) -> int | None:
    """The non-negative row count `have` holds under `key` (0 when absent), else None."""
    n = have.get(key, 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


class _Lines:
    """The complete lines appended to one JSON-lines file since the last read (a partial last line waits
    for its newline: the writer may be in the middle of it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = 0
        """Bytes after the last newline (a line being written, or torn)."""
        self.skipped = 0

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """New rows, and whether the file shrank (rewritten: a resumed run drops the steps it redoes)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return [], False
        reset = size < self.offset
        if reset:
            self.offset, self.skipped = 0, 0
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1
        self.offset += end
        self.pending = len(data) - end
        rows = []
        for line in jsonl_lines(data[:end].decode("utf-8", "replace")):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                row = None
            if isinstance(row, dict):
                rows.append(_clean(row))
            else:
                self.skipped += 1
        return rows, reset


class RunFollower:
    """One run directory, read incrementally: each :meth:`refresh` parses only what was appended.

    Raises :class:`RunError` when the path holds none of :data:`RUN_FILES`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.run = Path(path)
        if not self.run.is_dir():
            raise RunError(f"{self.run} is not a directory; pass a run directory (a trainer.output_dir)")
        if not any((self.run / f).exists() for f in RUN_FILES):
            raise RunError(f"{self.run} is not a run: it has none of {', '.join(RUN_FILES)}; pass a run directory "
                           "(a trainer.output_dir)")
        self.epoch = 0
        """Goes up when a file was rewritten (what the page holds must be replaced, not extended)."""
        self._metrics = _Lines(self.run / "metrics.jsonl")
        self._samples = _Lines(self.run / "samples.jsonl")
        self.metrics: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.bad_samples = 0
        self.trace: dict[str, Any] = {"tracks": [], "spans": []}
        self.trace_stamp = ""
        self.complete = False

    def refresh(self) -> None:
        """Read what was appended since the last refresh (and trace.json when it changed)."""
        rows, reset_m = self._metrics.read()
        samples, reset_s = self._samples.read()
        if reset_m or reset_s:  # start over: both files, so steps and trajectories stay one run
            self.epoch += 1
            self._metrics.offset = self._samples.offset = 0
            self._metrics.skipped = self._samples.skipped = 0
            self.metrics, self.evals, self.samples, self.bad_samples = [], [], [], 0
            rows, _ = self._metrics.read()
            samples, _ = self._samples.read()
        for r in rows:
            if r.get("kind") == "eval":
                self.evals.append(r)
            elif "step" in r:
                self.metrics.append(r)
        for r in samples:
            if _is_sample(r):
                self.samples.append(r)
            else:
                self.bad_samples += 1
        trace = self.run / "trace.json"
        try:
            st = trace.stat()
            ts = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            ts = ""
        if ts != self.trace_stamp:
            self.trace_stamp = ts
            self.trace = _clean(_spans(trace)) if ts else {"tracks": [], "spans": []}
        self.complete = _finished(self.run)

    def status(self) -> dict[str, Any]:
        """What exists, whether the run ended, and the lines skipped (a finished run's partial last line
        is torn: it counts)."""
        torn = self.complete
        return {
            "complete": self.complete, "exists": [f for f in RUN_FILES if (self.run / f).exists()],
            "skipped_metrics": self._metrics.skipped + int(torn and self._metrics.pending > 0),
            "skipped_samples": self._samples.skipped + self.bad_samples + int(torn and self._samples.pending > 0),
        }

    def snapshot(self, have: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run for the page: everything, or (`have`: the ``epoch``, the counts ``m``, ``e``, ``s`` of
        metrics, evaluation and sample rows, and the trace stamp ``t`` the page holds) what it lacks."""
        base = {"name": _clean(self.run.resolve().name), "path": _clean(str(self.run)), "epoch": self.epoch,
                "status": self.status(), "trace_stamp": self.trace_stamp}
        counts = [_count(have, k) for k in ("m", "e", "s")] if isinstance(have, dict) else [None]
        if have is None or have.get("epoch") != self.epoch or None in counts:  # a bad `have` gets everything
            return {**base, "mode": "full", "metrics": self.metrics, "evals": self.evals, "samples": self.samples,
                    "trace": self.trace}
        m, e, n = counts
        out = {**base, "mode": "append", "metrics": self.metrics[m:], "evals": self.evals[e:],
               "samples": self.samples[n:]}
        if have.get("t") != self.trace_stamp:
            out["trace"] = self.trace
        return out


def load_run(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything the page shows of one run directory. Raises :class:`RunError` when `path` holds
    none of :data:`RUN_FILES`."""
    f = RunFollower(path)
    f.refresh()
    return f.snapshot()


def load_runs(paths: Sequence[str | os.PathLike[str]]) -> dict[str, Any]:
    """The page's data: ``{"runs": [load_run(p) ...]}``."""
    return {"runs": [load_run(p) for p in paths]}


def describe(run: dict[str, Any]) -> str:
    """One line: what a run holds (for a run still being written, and for skipped lines)."""
    st = run["status"]
    have = [f"metrics.jsonl: {len(run['metrics'])} steps" if "metrics.jsonl" in st["exists"] else "no metrics.jsonl",
            f"samples.jsonl: {len(run['samples'])} trajectories" if "samples.jsonl" in st["exists"]
            else "no samples.jsonl",
            "trace.json" if "trace.json" in st["exists"] else "no trace.json yet"]
    skipped = [f"{n} unreadable {f} line{'s' if n != 1 else ''} skipped"
               for f, n in (("metrics.jsonl", st["skipped_metrics"]), ("samples.jsonl", st["skipped_samples"])) if n]
    return "; ".join(have + skipped)


def _static(name: str) -> str:
    return resources.files("asyncrl.pipelines.observe").joinpath("viewer_static", name).read_text(encoding="utf-8")


def _script_json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element: ``<``, ``>``, ``&`` and the line separators escaped."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_html(data: dict[str, Any] | None) -> str:
    """The page with its scripts inlined; `data` inlined too (a file), or None (served: it polls)."""
    page = _static("view.html")
    page = page.replace("/*UPLOT_CSS*/", _static("uPlot.min.css"))
    page = page.replace("/*UPLOT_JS*/", _static("uPlot.iife.min.js").replace("</script", "<\\/script"))
    payload = _script_json(data) if data is not None else "null"
    return page.replace("/*DATA*/null", payload)


def _handler(followers: list[RunFollower], page: str, host: str) -> type[http.server.BaseHTTPRequestHandler]:
    # a wildcard --host (0.0.0.0, ::) is the user's choice to be reached under any name
    allowed = None if host.strip("[]") in ("", "0.0.0.0", "::") else {"127.0.0.1", "localhost", "::1",
                                                                     host.strip("[]").lower()}
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            name = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
            if allowed is not None and name not in allowed:  # DNS rebinding: another site's name pointed here
                self._send(403, b"forbidden host", "text/plain; charset=utf-8")
            elif url.path in ("/", "/index.html"):
                self._send(200, page.encode(), "text/html; charset=utf-8")
            elif url.path == "/api/data":
                try:
                    have = json.loads(parse_qs(url.query).get("have", ["null"])[0])
                except ValueError:
                    have = None
                if not isinstance(have, list) or len(have) != len(followers):
                    have = [None] * len(followers)
                with lock:  # one refresh at a time: the followers' offsets are shared
                    runs = []
                    for f, h in zip(followers, have):
                        f.refresh()
                        runs.append(f.snapshot(h if isinstance(h, dict) else None))
                    body = json.dumps({"runs": runs}, ensure_ascii=False, allow_nan=False,
                                      separators=(",", ":")).encode()
                self._send(200, body, "application/json; charset=utf-8")
            else:
                self._send(404, b"not found", "text/plain; charset=utf-8")

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the page polls every 2 s
            pass

    return Handler


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False


def make_server(paths: Sequence[str | os.PathLike[str]], host: str = "127.0.0.1", port: int = 8765) -> _Server:
    """A server of the page for `paths` (not yet serving; ``serve_forever()``). Raises ``OSError`` when
    the port is taken. It answers only requests addressed to this machine by a loopback name or `host`
    (a page elsewhere cannot read it through a name it re-points here)."""
    return _Server((host, port), _handler([RunFollower(p) for p in paths], render_html(None), host))


def serve(paths: Sequence[str | os.PathLike[str]], host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve the page for `paths` until interrupted."""
    with make_server(paths, host, port) as srv:
        shown = f"[{host}]" if ":" in host else host
        print(f"asyncrl view: serving {len(paths)} run{'s' if len(paths) != 1 else ''} at http://{shown}:"
              f"{srv.server_address[1]}/ (Ctrl-C to stop)", file=sys.stderr, flush=True)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass

