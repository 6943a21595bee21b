"""The per-sample ledger of a run: what became of every sample, read from its journal, and the check of it.

A **sample** is one row of a prompt group: ``(group, row, seed)``. Batch ``i`` holds groups ``i * B .. i * B + B - 1``
(``B`` prompt groups per step, ``G`` rows each; dynamic sampling's extra calls of batch ``i`` hold the same group
numbers under their own seeds); a streaming run numbers its groups as it admits them. The journal
(:mod:`asyncrl.pipelines.journaling.journal`) says, in bulk records, when each sample was

* **admitted** -- its ``batch`` record (batch mode: generated and scored) or ``group`` record (streaming: issued),
  at a weight version;
* **trained** -- by the one ``step`` that took its batch or group (after a ``rewind``, the steps retrained);
* **dropped**, with its reason -- ``stale`` (``drop``, ``group_drop``), ``filtered`` (dynamic sampling's equal
  rewards: ``filter``, ``group_filter``) or ``left`` (admitted and not trained when the run ended: ``left``);

and the side file ``ledger.jsonl`` keeps, per step, what the trained rows' data says about how they were
**generated**: by which rollout replica (the rank that returned the row) and with which weight versions (the
oldest and newest of its model tokens), measured on the training pool from the batch itself
(:func:`row_facts`; fetched after the step took its batch, written off the controller's loop)::

    {"step": 3, "replica": [0, 0, 1, 1], "lo": [2, 2, 2, 3], "hi": [2, 3, 2, 3], "tokens": [8, 5, 8, 2]}

:func:`check_ledger` proves, naming the first offending samples when it fails:

* **nothing lost** -- every admitted sample was trained, or dropped with a reason; the run ended (``end``);
* **nothing trained twice** -- no sample in two steps, none both trained and dropped, every step ``0 .. steps - 1``
  present, each with a batch of ``trainer.batch_size`` admitted samples;
* **the staleness bound** -- every trained token's version ``v`` satisfies ``step - max_staleness <= v <= step``
  (measured; no token older than its sample's admission version), and the admission version too. A run with
  ``trainer.stream.bound=admitted`` bounds admission only: its tokens are checked for ``admission version <= v <=
  step``, and their ages are counted, not bounded.

``asyncrl ledger RUN`` runs it (exit 0 when it holds, 1 when not, 2 when RUN has no journal).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.pipelines.journaling.journal import JOURNAL, JournalData, JournalError, read_journal

__all__ = ["LEDGER", "LedgerFile", "LedgerReport", "Sample", "check_ledger", "read_samples", "row_facts",
           "read_ledger_rows"]

LEDGER = "ledger.jsonl"
"""The measured rows' file name, next to the journal."""

_FACTS = ("replica", "lo", "hi", "tokens")


def row_facts(batch: Any) -> Any:
    """Per row of a generated batch (a ``TensorDict``): ``replica`` (the ``replica`` field the rollout worker
    stamps, -1 without it), ``lo`` / ``hi`` (the oldest and newest weight version of its model tokens:
    ``token_versions`` under ``response_mask``, else the row's ``version``) and ``tokens`` (model tokens). Small:
    four int32 per row (the training pool computes it; :meth:`AdvantageWorker.ledger_rows`)."""
    import torch
    from tensordict import TensorDict

    n = int(batch.batch_size[0])
    keys = set(map(str, batch.keys()))
    mask = batch["response_mask"].bool()
    version = batch["version"].long() if "version" in keys else torch.full((n,), -1, dtype=torch.long)
    lo, hi = version.clone(), version.clone()
    if "token_versions" in keys:
        tv = batch["token_versions"].long()
        model = mask & (tv >= 0)
        has = model.any(1)
        big = torch.full_like(tv, 1 << 40)
        lo = torch.where(has, torch.where(model, tv, big).min(1).values, version)
        hi = torch.where(has, torch.where(model, tv, torch.full_like(tv, -1)).max(1).values, version)
    replica = batch["replica"].long() if "replica" in keys else torch.full((n,), -1, dtype=torch.long)
    return TensorDict({"replica": replica.int(), "lo": lo.int(), "hi": hi.int(), "tokens": mask.sum(1).int()},
                      batch_size=[n])


class LedgerFile:
    """Appends a run's ``ledger.jsonl`` (blocking file I/O: one line per step; call it in a thread).

    Args:
        path: the file (``<output_dir>/ledger.jsonl``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self, previous: Path | None, start_step: int) -> None:
        """Begin the file: keep the lines of `previous` (this run's, or the resumed run's) for steps before
        `start_step` (a resume or restart rewinds to its checkpoint), drop the rest."""
        kept = [r for s, r in sorted(read_ledger_rows(previous).items()) if s < start_step] if previous else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)

    def append(self, step: int, facts: Any | None, lost: str | None = None) -> None:
        """Step `step`'s rows as :func:`row_facts` measured them (a ``TensorDict``), or why they could not be
        (`lost`: the fetch failed; the check then reports the step as unmeasured)."""
        rec: dict[str, Any] = {"step": step}
        if facts is not None:
            rec.update({k: facts[k].tolist() for k in _FACTS})
        else:
            rec["lost"] = lost or "unknown"
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def read_ledger_rows(path: Path | None) -> dict[int, dict[str, Any]]:
    """The lines of a ``ledger.jsonl`` by step (the last line of a step wins; a missing file: none; a torn last
    line is ignored)."""
    if path is None or not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    out: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out[int(rec["step"])] = rec
        except (ValueError, KeyError, TypeError):
            if n == len(lines) - 1:
                break  # torn by a kill
            raise JournalError(f"{str(path)!r} line {n + 1} is not a ledger record: {line[:80]!r}; restore the "
                               "file the run wrote") from None
    return out


@dataclass
class Sample:
    """What became of one sample (see the module)."""

    group: int
    row: int
    seed: int
    admitted: int
    """The weight version at its admission (its batch's version; a streaming group's admission version)."""
    trained: list[int] = field(default_factory=list)
    """The steps that trained it (one, when the ledger holds)."""
    dropped: list[str] = field(default_factory=list)
    """Why it was not trained (``stale``, ``filtered``, ``left``)."""
    replica: int | None = None
    """The rollout replica (rank) that returned its row (measured; -1: the batch carries none)."""
    versions: tuple[int, int] | None = None
    """The oldest and newest weight version of its model tokens (measured)."""
    tokens: int | None = None
    """Its model tokens (measured)."""

    @property
    def name(self) -> str:
        """``group:row (seed s)``, as the check's messages name it."""
        return f"sample {self.group}:{self.row} (seed {self.seed})"

    def as_dict(self) -> dict[str, Any]:
        """One JSON-able line for ``asyncrl ledger --samples``."""
        return {"group": self.group, "row": self.row, "seed": self.seed, "admitted_version": self.admitted,
                "trained_step": self.trained[0] if len(self.trained) == 1 else self.trained or None,
                "dropped": self.dropped[0] if len(self.dropped) == 1 else self.dropped or None,
                "replica": self.replica, "versions": list(self.versions) if self.versions else None,
                "tokens": self.tokens}


@dataclass
class LedgerReport:
    """The outcome of :func:`check_ledger`."""

    samples: int = 0
    """Samples admitted."""
    trained: int = 0
    """Samples trained (once each when :attr:`ok`)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Samples dropped, by reason."""
    steps: int = 0
    """Steps the run recorded."""
    measured_steps: int = 0
    """Steps whose rows' generation facts were measured (``ledger.jsonl``)."""
    rewinds: int = 0
    """Restarts or resumes that went back to a checkpoint."""
    discarded_steps: int = 0
    """Steps trained and then discarded by those rewinds (their samples trained again)."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Trained samples by staleness: the step minus the version of the sample's oldest model token (measured)."""
    replicas: int = 0
    """Distinct rollout replicas that generated trained rows (measured)."""
    violations: list[str] = field(default_factory=list)
    """What breaks the ledger, naming the sample (at most ``limit`` of each kind are listed)."""
    counts: dict[str, int] = field(default_factory=dict)
    """Violations by kind (``lost``, ``trained_twice``, ``stale``, ``unadmitted``, ``unmeasured``, ``run``)."""

    @property
    def ok(self) -> bool:
        """True when nothing was lost or trained twice and every trained token keeps the bound."""
        return not self.violations

    @property
    def lost(self) -> int:
        """Admitted samples never trained nor dropped."""
        return self.counts.get("lost", 0)

    @property
    def trained_twice(self) -> int:
        """Samples trained more than once (or trained and dropped)."""
        return self.counts.get("trained_twice", 0)

    def render(self) -> str:
        """A few lines for a terminal."""
        dropped = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"
        hist = " ".join(f"{d}:{n}" for d, n in sorted(self.staleness.items())) or "-"
        lines = [f"samples admitted {self.samples}, trained {self.trained}, dropped {dropped}",
                 f"lost {self.lost}, trained twice {self.trained_twice}; steps {self.steps} "
                 f"({self.measured_steps} measured), rewinds {self.rewinds} ({self.discarded_steps} steps discarded)",
                 f"trained samples by staleness {hist}; replicas {self.replicas}",
                 "ledger holds" if self.ok else f"ledger BROKEN: {len(self.violations)} violation(s)"]
        return "\n".join(lines + [f"  {v}" for v in self.violations])


def _config(data: JournalData) -> dict[str, Any]:
    header = data.header or {}
    cfg = header.get("config")
    if not isinstance(cfg, dict):
        raise JournalError("the journal has no run record with the run's config; it is not a run journal")
    return cfg


def read_samples(run: str | Path) -> tuple[dict[tuple[int, int, int], Sample], JournalData, dict[int, list[Sample]]]:
    """Every sample of the run in `run` (a run directory, or its journal): ``({(group, row, seed): Sample},
    the journal, {step: its samples in batch order})``, with the measured facts of ``ledger.jsonl`` attached."""
    path = Path(run)
    data = read_journal(path)
    run_dir = path if path.is_dir() else path.parent
    cfg = _config(data)
    G = int(cfg["algorithm"]["group_size"])
    B = int(cfg["trainer"]["batch_size"]) // G
    samples: dict[tuple[int, int, int], Sample] = {}

    def admit(g: int, seed: int, version: int) -> list[Sample]:
        out = []
        for r in range(G):
            s = samples.setdefault((g, r, seed), Sample(g, r, seed, version))
            out.append(s)
        return out

    def drop(rows: list[Sample], why: str) -> None:
        for s in rows:
            s.dropped.append(why)

    # admitted: per batch, its groups in batch order (the trained order); per filter, every call's groups
    batch_rows: dict[int, list[Sample]] = {}
    for i, b in sorted(data.batches.items()):
        f = data.filters.get(i)
        seeds = [int(x) for x in f["seeds"]] if f is not None else [int(b["seed"])]
        calls = {(c, j): admit(i * B + j, seeds[c], int(b["version"])) for c in range(len(seeds)) for j in range(B)}
        picks = [tuple(p) for p in f["picks"]] if f is not None else [(0, j) for j in range(B)]
        batch_rows[i] = [s for p in picks for s in calls[p]]  # type: ignore[index]
        for p, rows in calls.items():
            if p not in picks:
                drop(rows, "filtered")
    group_rows = {g: admit(g, int(r["seed"]), int(r["version"])) for g, r in sorted(data.groups.items())}

    by_step: dict[int, list[Sample]] = {}
    for p, st in sorted(data.steps.items()):
        groups = st.get("rows", st.get("groups"))  # the batch's row order (``ledger.jsonl`` measures in it)
        if groups is not None:
            rows = [s for g in groups for s in group_rows.get(int(g), _ghost(int(g), G))]
        else:
            rows = batch_rows.get(int(st["batch"]), _ghost(int(st["batch"]) * B, G * B))
        by_step[p] = rows
        for s in rows:
            s.trained.append(p)
    for d in data.drops:
        drop(batch_rows.get(int(d["batch"]), []), "stale")
    for d in data.group_drops:
        drop(group_rows.get(int(d["index"]), []), "stale")
    for r in data.group_filters:
        drop(group_rows.get(int(r["index"]), []), "filtered")
    if data.left is not None:
        for i in data.left.get("batches", []):
            drop(batch_rows.get(int(i), []), "left")
        for g in data.left.get("groups", []):
            drop(group_rows.get(int(g), []), "left")

    measured = read_ledger_rows(run_dir / LEDGER)
    for p, rows in by_step.items():
        m = measured.get(p)
        if m is None or "lost" in m or len(m.get("lo", ())) != len(rows):
            continue
        for s, rep, lo, hi, n in zip(rows, m["replica"], m["lo"], m["hi"], m["tokens"]):
            s.replica, s.versions, s.tokens = int(rep), (int(lo), int(hi)), int(n)
    return samples, data, by_step


def _ghost(group: int, G: int) -> list[Sample]:
    """Stand-ins for the rows of a trained group the journal never admitted (reported as ``unadmitted``)."""
    return [Sample(group, -1, -1, -1)] * G


def check_ledger(run: str | Path, *, finished: bool = True, limit: int = 5) -> LedgerReport:
    """Check the ledger of the run in `run` (see the module); `finished`: the run must have ended (an ``end``
    record); `limit`: most violations listed per kind (all are counted). Raises :class:`JournalError` when `run`
    has no readable journal."""
    samples, data, by_step = read_samples(run)
    cfg = _config(data)
    k = int(cfg["trainer"]["max_staleness"])
    bounded = (cfg["trainer"].get("stream") or {}).get("bound", "trained") != "admitted"  # (older journals: trained)
    batch_size = int(cfg["trainer"]["batch_size"])
    run_dir = Path(run) if Path(run).is_dir() else Path(run).parent
    measured = read_ledger_rows(run_dir / LEDGER)
    rep = LedgerReport(samples=len(samples), steps=len(by_step), rewinds=len(data.rewinds),
                       discarded_steps=sum(len(r.get("discarded_steps", ())) for r in data.rewinds))
    counts: Counter[str] = Counter()

    def bad(kind: str, text: str) -> None:
        counts[kind] += 1
        if counts[kind] <= limit:
            rep.violations.append(f"{kind}: {text}")

    if finished and data.end is None:
        bad("run", f"the run has no end record in {JOURNAL}: it did not finish (killed, or still running); check "
                   "a finished run, or pass --unfinished to check what it recorded")
    last = int(data.end["steps"]) if data.end is not None else (max(by_step) + 1 if by_step else 0)
    for p in range(last):
        if p not in by_step:
            bad("lost", f"step {p} is not in the journal (the run ended after {last} steps)")
    replicas: set[int] = set()
    for p, rows in sorted(by_step.items()):
        if len(rows) != batch_size:
            bad("run", f"step {p} trained {len(rows)} samples, not trainer.batch_size={batch_size}")
        m = measured.get(p)
        if m is None or "lost" in m:
            why = m.get("lost") if m else "no line in " + LEDGER
            bad("unmeasured", f"step {p}'s rows were not measured ({why})")
        elif len(m.get("lo", ())) != len(rows):
            bad("unmeasured", f"step {p} measured {len(m.get('lo', ()))} rows for its {len(rows)} samples")
        else:
            rep.measured_steps += 1
        ghosts: set[int] = set()
        for s in rows:
            if s.row < 0:
                if s.group not in ghosts:
                    ghosts.add(s.group)
                    bad("unadmitted", f"step {p} trained group {s.group}, which the journal never admitted")
                continue
            if p < s.admitted or (bounded and p - s.admitted > k):
                bad("stale", f"{s.name} admitted at version {s.admitted} was trained at step {p} "
                             f"(max_staleness={k})")
            if s.versions is not None:
                lo, hi = s.versions
                replicas.add(s.replica if s.replica is not None else -1)
                if (bounded and p - lo > k) or hi > p or lo < s.admitted:
                    bad("stale", f"{s.name} trained at step {p} has tokens of versions {lo}..{hi} (admitted at "
                                 f"{s.admitted}, max_staleness={k})")
                rep.staleness[p - lo] = rep.staleness.get(p - lo, 0) + 1
    for s in samples.values():
        if len(s.trained) > 1:
            bad("trained_twice", f"{s.name} was trained at steps {s.trained}")
        elif s.trained and s.dropped:
            bad("trained_twice", f"{s.name} was trained at step {s.trained[0]} and dropped ({s.dropped[0]})")
        elif not s.trained and not s.dropped:
            bad("lost", f"{s.name}, admitted at version {s.admitted}, was never trained, dropped or left")
        elif len(s.dropped) > 1:
            bad("lost", f"{s.name} was dropped more than once ({', '.join(s.dropped)})")
        if len(s.trained) == 1:
            rep.trained += 1
        elif not s.trained and len(s.dropped) == 1:
            rep.dropped[s.dropped[0]] = rep.dropped.get(s.dropped[0], 0) + 1
    rep.replicas = len(replicas - {-1})
    rep.counts = dict(counts)
    return rep
