"""``asyncrl view`` without a browser: what it reads, the one-line answers to bad input (exit 2), the inlined
page's escaping, and the served JSON that a live page polls. The page itself: test_viewer_browser.py."""

from __future__ import annotations

import json
import math
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

from asyncrl.pipelines.observe import viewer
from asyncrl.pipelines.commands.cli import main

HOSTILE = "</script><script>window.__pwned = 1</script><img src=x onerror='window.__pwned=2'>\x00\x07\x1b[31m\u2028"


def sample(step: int, uid: int, index: int, *, reward: float = 0.0, stop: str = "stop", text: str = "ab") -> dict:
    pieces = list(text) or ["x"]
    n = len(pieces)
    return {"step": step, "uid": uid, "index": index, "row": index, "prompt": f"prompt {uid}", "response": text,
            "reward": reward, "version": max(0, step - 1), "staleness": min(step, 1), "stop_reason": stop,
            "length": n, "num_turns": None, "tool_errors": None, "episode_reward": None,
            "tokens": {"id": list(range(n)), "text": pieces, "mask": [1] * n, "version": [max(0, step - 1)] * n,
                       "logp_rollout": [-1.0] * n, "logp_old": [-1.25] * n, "advantage": [reward - 0.5] * n}}


def make_run(path, steps: int = 3, *, finished: bool = True, samples: list[dict] | None = None):
    path.mkdir(parents=True, exist_ok=True)
    with (path / "metrics.jsonl").open("w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "reward/mean": s / 10, "staleness/max": 1, "time/step": 0.5}) + "\n")
    rows = samples if samples is not None else [sample(s, s, i) for s in range(steps) for i in range(2)]
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    journal = [{"kind": "start"}] + ([{"kind": "end", "steps": steps}] if finished else [])
    (path / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in journal))
    return path


def fails(argv, capsys) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_path_that_is_not_a_run_gets_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    line = fails(["view", str(tmp_path / "empty"), "--out", str(tmp_path / "x.html")], capsys)
    assert "is not a run" in line and "metrics.jsonl" in line and "trainer.output_dir" in line
    line = fails(["view", str(tmp_path / "missing")], capsys)
    assert "is not a directory" in line
    assert not (tmp_path / "x.html").exists()


def test_a_run_still_being_written_shows_what_exists(tmp_path, capsys):
    run = make_run(tmp_path / "live", steps=2, finished=False)
    assert main(["view", str(run), "--out", str(tmp_path / "v.html")]) == 0
    err = capsys.readouterr().err
    assert "still being written" in err and "metrics.jsonl: 2 steps" in err and "samples.jsonl: 4 trajectories" in err
    assert "no trace.json yet" in err
    assert (tmp_path / "v.html").stat().st_size > 50_000  # the page, uPlot inlined


def test_a_truncated_samples_line_is_skipped_and_counted(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"step": 3, "uid": 0, "tokens": {"id": [1, 2')
    data = viewer.load_run(run)
    assert len(data["samples"]) == 6 and data["status"]["skipped_samples"] == 1
    assert main(["view", str(run), "--out", str(tmp_path / "v.html")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("1 unreadable samples.jsonl line skipped" in line for line in err), err


def test_a_port_in_use_names_the_port_and_the_flag(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = fails(["view", str(run), "--port", str(port)], capsys)
    assert f"127.0.0.1:{port}" in line and "--port" in line


def test_inlined_data_cannot_close_its_script_element(tmp_path):
    run = make_run(tmp_path / "run", samples=[sample(0, 0, 0, text=HOSTILE)])
    page = viewer.render_html(viewer.load_runs([run]))
    data = page[page.index('<script id="data"'):]
    data = data[:data.index("</script>")]
    assert "<" not in data.partition(">")[2]  # no markup inside the data element
    payload = json.loads(data.partition(">")[2])
    assert payload["runs"][0]["samples"][0]["response"] == HOSTILE  # the text itself survives


def get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url).read())


def test_the_server_listens_on_loopback_sends_only_what_the_page_lacks_and_refuses_other_hosts(tmp_path):
    run = make_run(tmp_path / "run", steps=2, finished=False)
    srv = viewer.make_server([run], port=0)
    assert srv.server_address[0] == "127.0.0.1"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        page = urllib.request.urlopen(base + "/").read().decode()
        assert "uPlot" in page and "/*DATA*/" not in page
        (first,) = get(base + "/api/data")["runs"]
        assert first["mode"] == "full" and len(first["metrics"]) == 2 and len(first["samples"]) == 4
        have = [{"epoch": first["epoch"], "m": 2, "e": 0, "s": 4, "t": first["trace_stamp"]}]
        query = base + "/api/data?have=" + urllib.parse.quote(json.dumps(have))
        (same,) = get(query)["runs"]
        assert (same["mode"], same["metrics"], same["samples"], "trace" in same) == ("append", [], [], False)
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 2, "reward/mean": 0.5}) + "\n")
            f.write('{"step": 3, "rew')  # being written: not a row yet, not skipped
            f.flush()
            (grown,) = get(query)["runs"]
            assert [r["step"] for r in grown["metrics"]] == [2] and grown["status"]["skipped_metrics"] == 0
            f.write('ard/mean": 0.7}\n')
        have[0]["m"] = 3
        (more,) = get(base + "/api/data?have=" + urllib.parse.quote(json.dumps(have)))["runs"]
        assert [r["step"] for r in more["metrics"]] == [3]
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.0}) + "\n")  # a resume rewrote it
        (again,) = get(query)["runs"]
        assert again["mode"] == "full" and again["epoch"] == first["epoch"] + 1 and len(again["metrics"]) == 1
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(base + "/../metrics.jsonl")
        rebound = urllib.request.Request(base + "/api/data", headers={"Host": "attacker.example:80"})
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(rebound)
    finally:
        srv.shutdown()
        srv.server_close()


def _served(runs):
    srv = viewer.make_server(runs, port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_nan_and_infinity_in_a_sample_reach_the_page_as_null_offline_and_live(tmp_path, capsys):
    bad = sample(1, 1, 0)
    bad["reward"] = math.nan
    bad["tokens"]["advantage"] = [math.inf, -math.inf]
    bad["tokens"]["logp_old"] = [math.nan, -1.0]
    run = make_run(tmp_path / "run", samples=[sample(0, 0, 0), bad])
    assert "NaN" in (run / "samples.jsonl").read_text()  # json.dumps writes them so (Python reads them back)
    out = tmp_path / "v.html"
    assert main(["view", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    page = out.read_text(encoding="utf-8")
    data = page.partition('<script id="data" type="application/json">')[2].partition("</script>")[0]
    payload = json.loads(data, parse_constant=lambda c: pytest.fail(f"{c} in the page"))
    shown = payload["runs"][0]["samples"][1]
    assert (shown["reward"], shown["tokens"]["advantage"], shown["tokens"]["logp_old"]) == (None, [None, None],
                                                                                            [None, -1.0])
    srv, base = _served([run])
    try:
        body = urllib.request.urlopen(base + "/api/data").read().decode()
        (live,) = json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in the served JSON"))["runs"]
        assert live["samples"][1]["tokens"]["advantage"] == [None, None]
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_lone_surrogate_is_shown_as_a_replacement_character_and_the_page_is_written(tmp_path, capsys):
    run = make_run(tmp_path / "run", samples=[sample(0, 0, 0)])
    with (run / "samples.jsonl").open("a") as f:  # JSON may escape a lone surrogate; UTF-8 cannot hold it
        f.write(json.dumps(sample(1, 1, 0, text="a\ud800")) + "\n")
    out = tmp_path / "v.html"
    assert main(["view", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    page = out.read_text(encoding="utf-8")
    assert out.stat().st_size > 50_000 and "a\ufffd" in page
    assert viewer.load_run(run)["samples"][1]["tokens"]["text"] == ["a", "\ufffd"]


def test_a_malformed_sample_row_is_skipped_and_counted_and_the_others_are_kept(tmp_path):
    rows = [sample(0, 0, i) for i in range(3)]
    rows[1]["tokens"]["mask"] = [1]  # shorter than its ids
    broken = [dict(sample(0, 1, 0), tokens={"id": 5, "text": None}), dict(sample(0, 2, 0), step="x"),
              dict(sample(0, 3, 0), tokens={**sample(0, 3, 0)["tokens"], "logp_old": "?"})]
    run = make_run(tmp_path / "run", samples=rows + broken)
    data = viewer.load_run(run)
    assert [(s["uid"], s["index"]) for s in data["samples"]] == [(0, 0), (0, 2)]
    assert data["status"]["skipped_samples"] == 4


@pytest.mark.parametrize("have", ['[{"epoch": 0, "m": "x"}]', '[{"epoch": 0, "m": -5, "s": 1e400}]', "[[1]]",
                                  '{"a": 1}', "[", '[{"epoch": 0, "t": {"x": 1}, "e": null}]'])
def test_a_bad_have_parameter_gets_the_whole_run_and_no_traceback(tmp_path, capfd, have):
    run = make_run(tmp_path / "run", steps=2)
    srv, base = _served([run])
    try:
        (got,) = get(base + "/api/data?have=" + urllib.parse.quote(have))["runs"]
        assert got["mode"] == "full" and len(got["metrics"]) == 2 and len(got["samples"]) == 4
    finally:
        srv.shutdown()
        srv.server_close()
    assert "Traceback" not in capfd.readouterr().err
