"""benchmarks/overlap.py --quick runs end to end (simulated PPO workers through the real
trainer and synchronous loop, plus a tiny real GRPO run) and writes the expected tables
and plot. No timing asserts: speed is measured by the benchmark, not by tests."""

from __future__ import annotations

SIM_COLUMNS = ["cost ratio", "max_staleness", "sync ms/step", "sync ideal", "sync eff.", "async ms/step",
               "async ideal", "async eff.", "speedup", "ideal speedup", "ctrl thread ms/step",
               "ctrl process ms/step"]
FLOOR_COLUMNS = ["cost ratio", "max_staleness", "ideal ms/step", "variant", "ms/step", "eff. vs ideal", "vs plain Ray",
                 "ctrl thread ms/step", "ctrl process ms/step"]
HOP_COLUMNS = ["cost ratio", "max_staleness", "variant", "process", "period ms", "stage overshoot ms", "idle ms",
               "idle before each stage, ms per step", "from the other process, ms"]
REAL_COLUMNS = ["workload", "mode", "steps", "loop s", "ms/step", "rollout ms", "train+sync ms", "ideal ms/step",
                "eff.", "speedup", "reward first 5", "reward last 10", "s to reward ≥ 0.5",
                "ctrl thread ms/step", "ctrl process ms/step"]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of `text`, as rows of cells (header first, separator dropped)."""
    out: list[list[list[str]]] = []
    prev = False
    for ln in text.splitlines():
        is_row = ln.startswith("|")
        if is_row and not set(ln) <= set("|-: "):
            if not prev:
                out.append([])
            out[-1].append([c.strip() for c in ln.strip("|").split("|")])
        prev = is_row
    return out


def test_overlap_quick(quick_runs):
    text = quick_runs.text("overlap")
    floor, hops, sim, real = tables(text)
    assert floor[0] == FLOOR_COLUMNS
    assert [(r[0], r[1], r[3]) for r in floor[1:]] == [("1", k, v) for k in ("1", "0") for v in
                                                       ("asyncrl trainer", "asyncrl trainer, trace off", "plain Ray")]
    assert floor[3][6] == "1.000x" and floor[6][6] == "1.000x"  # the plain-Ray floor is its own baseline
    for r in floor[1:]:
        assert all(float(c.rstrip("x")) > 0 for c in r[4:])
    assert hops[0] == HOP_COLUMNS  # where each step's time went, per worker process
    assert [tuple(r[:4]) for r in hops[1:]] == [("1", k, v, p) for k in ("1", "0") for v in
                                                ("asyncrl trainer", "asyncrl trainer, trace off", "plain Ray")
                                                for p in ("rollout", "train")]
    for r in hops[1:]:
        assert float(r[4]) > 0 and float(r[6]) >= 0  # period, idle
        stages = ("update_weights", "generate", "score") if r[3] == "rollout" else (
            "old_log_prob", "values", "advantages", "critic_update", "actor_update", "export_weights")
        assert [part.rsplit(" ", 1)[0] for part in r[7].split(", ")] == list(stages)
    assert sim[0] == SIM_COLUMNS
    assert [(r[0], r[1]) for r in sim[1:]] == [(ratio, k) for ratio in ("0.25", "0.5", "1", "2", "4")
                                                for k in ("0", "1", "2")]
    for r in sim[1:]:
        assert all(float(c.rstrip("x")) > 0 for c in r[2:])
    assert real[0] == REAL_COLUMNS
    assert [(r[0], r[1], r[2]) for r in real[1:]] == [("grpo_toy", "sync (max_staleness=0)", "3"),
                                                       ("grpo_toy", "async (max_staleness=1)", "3")]
    assert real[1][9] == "1.00x"  # the synchronous run is its own baseline
    assert "At cost ratio 1, max_staleness=1: efficiency" in text
    assert "At cost ratio 1, max_staleness=1: the trainer's efficiency" in text
    png = quick_runs.path("overlap.png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
