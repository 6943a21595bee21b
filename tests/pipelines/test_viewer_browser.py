"""``asyncrl view`` in a real browser: the distribution's headless Chromium (``/usr/bin/chromium``, installed by
``bash scripts/setup.sh test``) driven by Playwright. The page of a real short run shows metrics.jsonl's numbers
and samples.jsonl's tokens, its filters work, model output renders as text, and the console stays clean.
Skipped where Chromium or Playwright is missing (never ``playwright install``: the distribution's browser is used).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
import time

import pytest

from asyncrl.pipelines.observe import viewer
from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.observe.samples import read_samples
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from tests.pipelines.test_samples import check_run
from tests.pipelines.test_viewer import HOSTILE, make_run, sample

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """A 3-step run of the tiny model, 4 trajectories a step, one step of staleness."""
    out = tmp_path_factory.mktemp("view") / "run"
    cfg = tiny_test()
    cfg.trainer.max_staleness = 1
    cfg.trainer.output_dir = str(out)
    GRPOTrainer(cfg.validate()).fit_sync()
    return out


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"no {CHROMIUM} (apt-get install chromium; scripts/setup.sh test does)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page_of(browser, tmp_path):
    """Opens the --out page of some runs; after the test, the console must have shown no error."""
    pages, errors = [], []

    def open_(*runs, html=None):
        html = html or tmp_path / "view.html"
        assert main(["view", *map(str, runs), "--out", str(html)]) == 0
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(html.as_uri())
        page.wait_for_selector("#status .run-status")
        pages.append(page)
        return page

    yield open_
    for p in pages:
        p.close()
    assert errors == []


def show(page, view: str) -> None:
    page.click(f"nav button[data-view={view}]")


def test_the_run_wrote_the_samples_the_page_shows(run):
    check_run(run, 3, 4)


def test_the_numbers_on_the_page_equal_metrics_jsonl(run, page_of):
    page = page_of(run)
    titles = page.eval_on_selector_all(".chart", "els => els.map(e => e.dataset.title)")
    assert titles[:1] == ["reward (mean of the training batch)"] and len(titles) >= 3
    rows = read_jsonl(run / "metrics.jsonl")
    for row in rows:
        page.fill("#m-step", str(row["step"]))
        shown = dict(page.eval_on_selector_all("#step-table tbody tr",
                                               "trs => trs.map(t => [t.dataset.key, t.querySelector('.val').textContent])"))
        assert set(shown) == set(row)
        for k, v in row.items():
            if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
                assert float(shown[k]) == v, (row["step"], k)


def test_a_trajectorys_tokens_masks_and_versions_equal_samples_jsonl(run, page_of):
    page = page_of(run)
    show(page, "traj")
    samples, _ = read_samples(run / "samples.jsonl")
    by_key = {(s["step"], s["uid"], s["index"]): s for s in samples}
    shown = page.eval_on_selector_all(".traj", """els => els.map(e => ({
        step: +e.dataset.step, uid: +e.dataset.uid, index: +e.dataset.index,
        ids: [...e.querySelectorAll('.tok')].map(t => +t.dataset.id),
        mask: [...e.querySelectorAll('.tok')].map(t => +t.dataset.mask),
        version: [...e.querySelectorAll('.tok')].map(t => +t.dataset.version),
        text: [...e.querySelectorAll('.tok')].map(t => t.textContent)}))""")
    assert len(shown) == len(samples) == 12
    for t in shown:
        s = by_key[(t["step"], t["uid"], t["index"])]
        assert t["ids"] == s["tokens"]["id"]
        assert t["mask"] == s["tokens"]["mask"]
        assert t["version"] == s["tokens"]["version"]
        assert len(t["text"]) == len(s["tokens"]["text"])
    groups = page.eval_on_selector_all(".group", "gs => gs.map(g => g.querySelectorAll('.traj').length)")
    assert groups == [4, 4, 4]  # a prompt group's members side by side


def test_the_timeline_draws_every_span_of_trace_json_on_its_worker_lane(run, page_of):
    page = page_of(run)
    show(page, "timeline")
    events = [e for e in json.loads((run / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    assert page.eval_on_selector_all("#timeline rect.span", "rs => rs.length") == len(events) > 0
    lanes = page.eval_on_selector_all("#timeline > text", "ts => ts.map(t => t.textContent)")
    assert any(x.startswith("train.policy") for x in lanes) and any(x.startswith("rollout.rollout") for x in lanes)
    names = set(page.eval_on_selector_all("#timeline rect.span title", "ts => ts.map(t => t.textContent.split('  ')[0])"))
    assert {"generate", "actor_update", "sample_trajectories"} <= names


def count(page) -> int:
    return int(re.match(r"(\d+) trajectories", page.inner_text("#traj-count")).group(1))


def test_the_filters_select_by_step_reward_staleness_and_stop_reason(tmp_path, page_of):
    rows = [sample(s, 10 * s + g, i, reward=float(i % 2), stop="max_length" if i == 3 else "stop")
            for s in range(4) for g in range(2) for i in range(4)]
    page = page_of(make_run(tmp_path / "run", steps=4, samples=rows))
    show(page, "traj")
    assert count(page) == 32
    page.fill("#f-step-min", "1")
    page.fill("#f-step-max", "2")
    assert count(page) == 16
    assert set(page.eval_on_selector_all(".traj", "els => els.map(e => +e.dataset.step)")) == {1, 2}
    page.fill("#f-reward-min", "0.5")
    assert count(page) == 8
    page.select_option("#f-stop", "max_length")
    assert count(page) == 4
    page.fill("#f-reward-min", "")
    page.fill("#f-step-min", "")
    page.fill("#f-step-max", "")
    page.select_option("#f-stop", "")
    page.select_option("#f-stale", "0")
    assert count(page) == 8  # step 0 only
    for mode in ("version", "advantage", "mismatch", "mask"):
        page.select_option("#f-color", mode)
        assert count(page) == 8


def test_model_output_renders_as_text_never_as_markup(tmp_path, page_of):
    rows = [sample(0, 0, 0, text=HOSTILE)]
    rows[0]["prompt"] = "<b>bold</b><script>window.__pwned = 3</script>"
    page = page_of(make_run(tmp_path / "run", steps=1, samples=rows))
    show(page, "traj")
    assert page.evaluate("window.__pwned") is None
    assert page.eval_on_selector_all("#traj-list img, #traj-list script, #traj-list b", "els => els.length") == 0
    tokens = page.inner_text(".traj .tokens")
    assert "<script>window.__pwned = 1</script>" in tokens and "<img src=x" in tokens
    assert "\\x00" in tokens and "\\x1b" in tokens  # control characters shown as escapes
    assert page.inner_text(".traj .prompt").startswith("<b>bold</b><script>")


def test_several_runs_side_by_side_and_a_live_run_updates(tmp_path, browser):
    a, b = make_run(tmp_path / "a", steps=3), make_run(tmp_path / "b", steps=2, finished=False)
    srv = viewer.make_server([a, b], port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/")
        page.wait_for_selector("#status .run-status >> nth=1")
        assert "still being written" in page.inner_text("#status")
        labels = page.eval_on_selector_all(".chart .u-legend .u-label", "els => els.map(e => e.textContent)")
        assert "a reward/mean" in labels and "b reward/mean" in labels
        with (b / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 2, "reward/mean": 0.9, "staleness/max": 1, "time/step": 0.5}) + "\n")
        page.locator("#status .run-status", has_text="b  ·  3 steps").wait_for(timeout=10_000)  # the next poll
    finally:
        page.close()
        srv.shutdown()
        srv.server_close()
    assert errors == []


@pytest.mark.slow
def test_open_time_of_a_10000_step_run_with_8_samples_per_step(tmp_path, browser):
    """Logged, not asserted (the issue's target: under 2 s)."""
    run = tmp_path / "big"
    run.mkdir()
    with (run / "metrics.jsonl").open("w") as f:
        for s in range(10_000):
            f.write(json.dumps({"step": s, "reward/mean": math.sin(s / 500), "staleness/max": s % 2,
                                "staleness/mean": 0.5, "time/step": 0.3, "actor/pg_loss": 0.01}) + "\n")
    with (run / "samples.jsonl").open("w") as f:
        for s in range(10_000):
            for i in range(8):
                f.write(json.dumps(sample(s, s * 2 + i // 4, i % 4, reward=float(i % 2), text="twelve chars")) + "\n")
    (run / "journal.jsonl").write_text('{"kind": "end"}\n')
    html = tmp_path / "big.html"
    t0 = time.perf_counter()
    assert main(["view", str(run), "--out", str(html)]) == 0
    t1 = time.perf_counter()
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(html.as_uri())
    page.wait_for_selector(".chart")
    page.wait_for_selector("#step-table tbody tr")
    t2 = time.perf_counter()
    show(page, "traj")
    page.wait_for_selector(".traj")
    t3 = time.perf_counter()
    page.close()
    assert errors == []
    print(f"\n10,000 steps x 8 samples: {html.stat().st_size / 1e6:.1f} MB page written in {t1 - t0:.2f} s; "
          f"opened (parsed, charts and step table drawn) in {t2 - t1:.2f} s; trajectory view in {t3 - t2:.2f} s")


def _rgba(css: str) -> tuple[float, ...]:
    """``rgb(1, 2, 3)`` / ``rgba(1, 2, 3, 0.5)`` as four numbers."""
    parts = [float(x) for x in re.findall(r"[\d.]+", css)]
    return tuple(parts + [1.0] * (4 - len(parts)))


def _colours(page) -> list[tuple[float, ...]]:
    js = "ts => ts.map(t => getComputedStyle(t).backgroundColor)"
    return [_rgba(c) for c in page.eval_on_selector_all(".traj .tok", js)]


def test_each_colour_mode_paints_each_token_by_its_rule(tmp_path, page_of):
    """The offline page of known rows, read back as the browser renders it: per token, the background colour each
    mode gives (mask, weight version, advantage scaled by the trajectory's largest, log-prob mismatch scaled to
    0.5), and the legend that explains it."""
    row = sample(2, 0, 0, text="abcd")
    row["tokens"].update(mask=[1, 1, 0, 1], version=[0, 1, -1, 9], advantage=[1.0, -0.5, 0.3, -1.0],
                         logp_old=[-1.0, -2.0, -1.0, -1.25], logp_rollout=[-1.0, -2.25, -3.0, -2.0])
    page = page_of(make_run(tmp_path / "run", steps=3, samples=[row]))
    show(page, "traj")
    assert page.eval_on_selector_all(".traj .tok", "ts => ts.map(t => t.textContent)") == ["a", "b", "c", "d"]
    assert page.eval_on_selector_all(".traj .tok", "ts => ts.map(t => t.title)")[1:3] == [
        "id 1 · mask 1 · version 1 · behaviour logp -2.25 · trained logp -2 · advantage -0.5",
        "id 2 · mask 0 · version -1 · behaviour logp -3 · trained logp -1 · advantage 0.3"]
    assert page.inner_text(".traj .meta") == "#0 · reward 0 · staleness 1 · version 1 · stop: stop · 4 tokens"
    blue, grey, pale = (207, 227, 255, 1), (230, 230, 230, 1), (240, 240, 240, 1)
    green, red, orange = (44, 160, 44), (214, 39, 40), (255, 127, 14)
    want = {
        "mask": [blue, blue, grey, blue],  # the environment's token (mask 0) is grey
        "version": [(142, 197, 255, 1), (255, 179, 167, 1), grey, (255, 179, 167, 1)],  # version 9 wraps to 1's
        "advantage": [(*green, 0.75), (*red, 0.45), pale, (*red, 0.75)],  # |a| / max |a| = 1, 0.5, -, 1
        "mismatch": [(*orange, 0.08), (*orange, 0.48), pale, (*orange, 0.88)],  # |old - behaviour| 0, 0.25, -, 0.75
    }
    legends = {"mask": "blue: the model's tokens", "version": "colour: the weight version",
               "advantage": "green: positive advantage, red: negative", "mismatch": "orange: |log-prob under"}
    for mode in ("version", "advantage", "mismatch", "mask"):
        page.select_option("#f-color", mode)
        got = _colours(page)
        assert [c == pytest.approx(w, abs=0.006) for c, w in zip(got, want[mode])] == [True] * 4, (mode, got)
        assert page.inner_text("#color-legend").startswith(legends[mode])


def test_bidi_controls_are_shown_as_escapes_so_a_response_cannot_reorder_itself(tmp_path, page_of):
    rows = [sample(0, 0, 0, text="ok \u202egnp.exe\u202c \u2066x\u2069")]
    rows[0]["prompt"] = "say \u202eevil"
    page = page_of(make_run(tmp_path / "run", steps=1, samples=rows))
    show(page, "traj")
    shown = page.inner_text("#traj-list")
    assert not set(shown) & {"\u202e", "\u202c", "\u2066", "\u2069"}
    assert page.eval_on_selector_all(".traj .tok", "ts => ts.map(t => t.textContent)")[3:5] == ["\\u202e", "g"]
    assert page.inner_text(".traj .prompt") == "say \\u202eevil"


def test_a_malformed_row_is_counted_and_the_others_are_drawn(tmp_path, page_of):
    rows = [sample(0, 0, i) for i in range(3)]
    run = make_run(tmp_path / "run", steps=1, samples=rows)
    with (run / "samples.jsonl").open("a") as f:
        bad = sample(0, 0, 3)
        bad["tokens"]["text"] = "ab"  # not a column
        f.write(json.dumps(bad) + "\n")
    page = page_of(run)
    show(page, "traj")
    assert count(page) == 3 and page.eval_on_selector_all(".traj", "els => els.length") == 3
    assert "1 unreadable samples.jsonl lines skipped" in page.inner_text("#status")


def test_a_live_page_shows_a_run_whose_samples_hold_nan(tmp_path, browser):
    bad = sample(1, 1, 0)
    bad["reward"], bad["tokens"]["advantage"] = math.nan, [math.inf, 0.5]
    run = make_run(tmp_path / "run", steps=2, samples=[sample(0, 0, 0), bad])
    srv = viewer.make_server([run], port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/")
        page.wait_for_selector("#status .run-status")
        show(page, "traj")
        assert count(page) == 2
        heads = page.eval_on_selector_all(".traj .meta", "ms => ms.map(m => m.textContent)")
        assert any(h.startswith("#0 · reward – ·") for h in heads)  # NaN arrives as null, shown as a dash
    finally:
        page.close()
        srv.shutdown()
        srv.server_close()
    assert errors == []
