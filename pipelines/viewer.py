"""``asyncrl view``: one page for one or more runs (metric curves, the overlap timeline, the
sampled trajectories), served live or written as one self-contained file.

::

    run dirs ─► load_run (metrics.jsonl, samples.jsonl, trace.json, journal.jsonl) ─► JSON
      ├─ --out FILE.html: the page with its scripts and the JSON inlined (works offline)
      └─ serve: ThreadingHTTPServer on loopback; GET /  the page, GET /api/data?since=STAMP the JSON
         (``{"unchanged": true}`` while no file changed; the page polls it, so a live run updates)

The page (``viewer_static/view.html``) draws with the vendored uPlot and plain SVG and renders
every piece of model output with ``textContent``: a response is untrusted text. Inlined JSON
escapes ``<``, so no text can close the ``<script>`` element that carries it.
"""

from __future__ import annotations

import http.server
import json
import math
import os
import sys
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qs, urlparse

from asyncrl.pipelines.samples import read_samples

__all__ = ["RunError", "RUN_FILES", "describe", "load_run", "load_runs", "make_server", "render_html", "serve", "stamp"]

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "trace.json", "journal.jsonl")
"""The files of a run directory the viewer reads (any one makes a directory a run)."""

MAX_SPANS = 50_000
"""Spans drawn of one run's trace (the last ones when there are more)."""


class RunError(ValueError):
    """Raised when a path given to ``asyncrl view`` is not a run directory."""


@dataclass
class _Status:
    complete: bool
    exists: list[str]
    skipped_metrics: int
    skipped_samples: int


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    rows: list[dict[str, Any]] = []
    bad = 0
    if not path.exists():
        return rows, 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def _finished(run: Path) -> bool:
    """Whether the run ended: its journal's last record is ``end`` (or, without a journal, trace.json exists)."""
    j = run / "journal.jsonl"
    if j.exists():
        with j.open("rb") as f:
            f.seek(max(0, j.stat().st_size - 4096))
            tail = f.read().decode("utf-8", "replace").splitlines()
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
        events = json.loads(trace.read_text()).get("traceEvents", [])
    except (OSError, ValueError, AttributeError):
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


def _plain(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def load_run(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything the page shows of one run directory. Raises :class:`RunError` when `path` holds
    none of :data:`RUN_FILES`."""
    run = Path(path)
    if not run.is_dir():
        raise RunError(f"{run} is not a directory; pass a run directory (a trainer.output_dir)")
    exists = [f for f in RUN_FILES if (run / f).exists()]
    if not exists:
        raise RunError(f"{run} is not a run: it has none of {', '.join(RUN_FILES)}; pass a run directory "
                       "(a trainer.output_dir)")
    rows, bad_m = _read_jsonl(run / "metrics.jsonl")
    train = [{k: _plain(v) for k, v in r.items()} for r in rows if r.get("kind") != "eval" and "step" in r]
    evals = [{k: _plain(v) for k, v in r.items()} for r in rows if r.get("kind") == "eval"]
    samples, bad_s = read_samples(run / "samples.jsonl")
    status = _Status(_finished(run), exists, bad_m, bad_s)
    return {
        "name": run.resolve().name, "path": str(run), "metrics": train, "evals": evals, "samples": samples,
        "trace": _spans(run / "trace.json") if (run / "trace.json").exists() else {"tracks": [], "spans": []},
        "status": status.__dict__,
    }


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


def stamp(paths: Sequence[str | os.PathLike[str]]) -> str:
    """Changes whenever a file the page shows changes (size and modification time)."""
    parts = []
    for p in paths:
        for f in RUN_FILES:
            try:
                s = (Path(p) / f).stat()
                parts.append(f"{s.st_size}:{s.st_mtime_ns}")
            except OSError:
                parts.append("-")
    return ".".join(parts)


def _static(name: str) -> str:
    return resources.files("asyncrl.pipelines").joinpath("viewer_static", name).read_text(encoding="utf-8")


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


def _handler(paths: list[str], page: str, host: str) -> type[http.server.BaseHTTPRequestHandler]:
    # a wildcard --host (0.0.0.0, ::) is the user's choice to be reached under any name
    allowed = None if host.strip("[]") in ("", "0.0.0.0", "::") else {"127.0.0.1", "localhost", "::1",
                                                                     host.strip("[]").lower()}
    cache: dict[str, Any] = {}
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
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
            if allowed is not None and host not in allowed:  # DNS rebinding: a web page's own name resolved to this address
                self._send(403, b"forbidden host", "text/plain; charset=utf-8")
            elif url.path in ("/", "/index.html"):
                self._send(200, page.encode(), "text/html; charset=utf-8")
            elif url.path == "/api/data":
                since = parse_qs(url.query).get("since", [""])[0]
                with lock:
                    now = stamp(paths)
                    if since == now:
                        body = b'{"unchanged":true}'
                    else:
                        if cache.get("stamp") != now:
                            try:
                                data = load_runs(paths)
                            except RunError as e:  # a run directory removed while served
                                data = {"error": str(e), "runs": []}
                            cache.update(stamp=now, body=json.dumps({"stamp": now, **data}, ensure_ascii=False,
                                                                    separators=(",", ":")).encode())
                        body = cache["body"]
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
    return _Server((host, port), _handler([str(p) for p in paths], render_html(None), host))


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

