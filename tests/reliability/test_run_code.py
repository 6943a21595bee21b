"""A run directory is code you trust: the reward file a run names is imported again by ``--resume`` and by
``asyncrl replay``; a file whose contents changed since the run is refused before anything imports it."""

from __future__ import annotations

import pytest

from asyncrl.pipelines.commands.cli import main

REWARD = '''
import os
MARK = os.environ.get("ASYNCRL_TEST_MARK")
if MARK and os.path.exists(os.path.dirname(MARK)):
    open(MARK, "a").write("imported\\n")

def score(x):
    return [float("1" in r) for r in x.responses]
'''


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """A 2-step run whose reward is a file of its own, checkpointed at the end."""
    root = tmp_path_factory.mktemp("runcode")
    (root / "my_reward.py").write_text(REWARD)
    out = root / "run"
    args = ["train", "--preset", "grpo_toy", f"reward.fn={root / 'my_reward.py'}:score", "trainer.steps=2",
            "model.num_layers=1", "model.hidden_size=32", "trainer.progress=false", f"trainer.output_dir={out}"]
    assert main(args) == 0
    return root, out


@pytest.mark.parametrize("command", ["resume", "replay"])
def test_a_reward_file_changed_since_the_run_is_refused_before_it_is_imported(run, command, capsys, tmp_path,
                                                                                monkeypatch):
    root, out = run
    reward = root / "my_reward.py"
    original = reward.read_text()
    mark = tmp_path / "imported.txt"
    monkeypatch.setenv("ASYNCRL_TEST_MARK", str(mark))
    reward.write_text(original + "\n# edited\n")
    try:
        argv = (["train", "--resume", str(out), "trainer.steps=3"] if command == "resume"
                else ["replay", str(out), "--output-dir", str(tmp_path / "replay")])
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        where = "checkpoint" if command == "resume" else "the journal of"
        assert len(err) == 1 and f"reward.fn: '{reward}' changed since {where}" in err[0], err
        assert "it is refused: put the original file back, or start a new run" in err[0]
        assert not mark.exists()  # refused before the edited file ran
    finally:
        reward.write_text(original)
    reward.unlink()
    try:
        assert main(["train", "--resume", str(out), "trainer.steps=3"]) == 2
        assert f"reward.fn: '{reward}' is gone since checkpoint" in capsys.readouterr().err
    finally:
        reward.write_text(original)


def test_the_unchanged_reward_file_resumes(run):
    _, out = run
    assert main(["train", "--resume", str(out), "trainer.steps=3", "trainer.progress=false"]) == 0


def _forge(run_dir, tmp_path, command: str, edit) -> list[str]:
    """A copy of `run_dir` whose checkpoint state (resume) or journal header (replay) `edit` changed; the argv
    that resumes or replays it."""
    import json
    import shutil

    from asyncrl.pipelines.checkpoints import checkpoint as ckpt

    forged = tmp_path / "forged"
    shutil.copytree(run_dir, forged)
    if command == "resume":
        f = ckpt.latest_checkpoint(forged) / "state.json"
        record = json.loads(f.read_text())
        edit(record)
        f.write_text(json.dumps(record))
        journal = forged / "journal.jsonl"  # a thorough forger makes the journal's header agree (check_own)
        head, *rest = journal.read_text().split("\n")
        header = json.loads(head)
        header["fingerprint"] = record.get("fingerprint")
        journal.write_text("\n".join([json.dumps(header), *rest]))
        return ["train", "--resume", str(forged), "trainer.steps=3"]
    f = forged / "journal.jsonl"
    head, *rest = f.read_text().split("\n")
    record = json.loads(head)
    edit(record)
    f.write_text("\n".join([json.dumps(record), *rest]))
    return ["replay", str(forged), "--output-dir", str(tmp_path / "replay")]


@pytest.mark.parametrize("command", ["resume", "replay"])
def test_a_record_naming_other_code_without_its_digest_is_refused_before_that_code_is_imported(
        run, command, capsys, tmp_path, monkeypatch):
    _, out = run
    evil = tmp_path / "evil.py"
    evil.write_text(REWARD)
    mark = tmp_path / "imported.txt"
    monkeypatch.setenv("ASYNCRL_TEST_MARK", str(mark))

    def edit(record):
        record["config"]["reward"]["fn"] = f"{evil}:score"
        del record["code_digests"]

    argv = _forge(out, tmp_path, command, edit)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    where = "checkpoint" if command == "resume" else "the journal of"
    assert len(err) == 1 and f"reward.fn: {str(evil)!r} is code" in err[0] and f"but {where}" in err[0], err
    assert "records no digest of it" in err[0]
    assert not mark.exists()  # refused before the file ran


@pytest.mark.parametrize("command", ["resume", "replay"])
def test_a_record_whose_config_no_longer_hashes_to_its_fingerprint_is_refused_naming_that(run, command, capsys,
                                                                                         tmp_path):
    _, out = run

    def edit(record):
        record["config"]["trainer"]["seed"] = 7

    assert main(_forge(out, tmp_path, command, edit)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was edited: its config does not hash to the fingerprint it records" in err[0], err
    assert "?" not in err[0]


MODULE = "asyncrl_trust_reward_mod"


@pytest.mark.parametrize("command", ["resume", "replay"])
def test_a_reward_module_changed_since_the_run_is_refused_before_it_is_imported(run, command, capsys, tmp_path,
                                                                               monkeypatch):
    """``reward.fn=package.module:fn`` is digested as a file is (the module's source, found without importing
    it), so an edited module is refused as an edited file is."""
    import sys

    from asyncrl.pipelines.datasets.datafiles import code_digests, content_digest
    from asyncrl.pipelines.job.config import JobConfig, config_fingerprint
    from asyncrl.pipelines.configlib import from_dict

    _, out = run
    pkg = tmp_path / "site"
    pkg.mkdir()
    source = pkg / f"{MODULE}.py"
    source.write_text(REWARD)
    monkeypatch.syspath_prepend(str(pkg))
    mark = tmp_path / "imported.txt"
    monkeypatch.setenv("ASYNCRL_TEST_MARK", str(mark))

    def as_if_run_with_the_module(record):  # what a run naming the module writes
        record["config"]["reward"]["fn"] = f"{MODULE}:score"
        record["code_digests"] = code_digests(record["config"])
        record["fingerprint"] = config_fingerprint(from_dict(JobConfig, record["config"]))

    argv = _forge(out, tmp_path, command, as_if_run_with_the_module)
    assert code_digests({"reward": {"fn": f"{MODULE}:score"}}) == {f"reward.fn:{MODULE}": content_digest(str(source))}
    assert MODULE not in sys.modules and not mark.exists()  # digested without being imported
    source.write_text(REWARD + "\n# edited\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    where = "checkpoint" if command == "resume" else "the journal of"
    assert len(err) == 1 and f"reward.fn: module {MODULE!r} ({source}) changed since {where}" in err[0], err
    assert MODULE not in sys.modules and not mark.exists()
    source.unlink()
    assert main(argv) == 2
    assert f"reward.fn: module {MODULE!r} (not found) is gone since {where}" in capsys.readouterr().err


def test_module_source_finds_a_module_s_file_without_importing_it_or_its_package(tmp_path, monkeypatch):
    import sys

    from asyncrl.pipelines.datasets.datafiles import module_source

    (tmp_path / "asyncrl_trust_pkg").mkdir()
    (tmp_path / "asyncrl_trust_pkg" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "asyncrl_trust_pkg" / "rewards.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_source("asyncrl_trust_pkg.rewards") == str(tmp_path / "asyncrl_trust_pkg" / "rewards.py")
    assert module_source("asyncrl_trust_pkg") == str(tmp_path / "asyncrl_trust_pkg" / "__init__.py")
    assert "asyncrl_trust_pkg" not in sys.modules
    assert module_source("asyncrl_trust_pkg.missing") is None and module_source("not a module") is None
    import asyncrl.roles.scoring.reward as installed  # an installed (editable) package's module is found too

    assert module_source("asyncrl.roles.scoring.reward") == installed.__file__


def _other_run(run_dir, tmp_path):
    """A copy of `run_dir` re-labelled as another run (another seed: its own config and fingerprint)."""
    import json
    import shutil

    from asyncrl.pipelines.checkpoints import checkpoint as ckpt
    from asyncrl.pipelines.job.config import JobConfig, config_fingerprint
    from asyncrl.pipelines.configlib import from_dict

    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    f = ckpt.latest_checkpoint(other) / "state.json"
    state = json.loads(f.read_text())
    state["config"]["trainer"]["seed"] = 11
    state["fingerprint"] = config_fingerprint(from_dict(JobConfig, state["config"]))
    f.write_text(json.dumps(state))
    ckpt.write_manifest(f.parent)  # a whole checkpoint, as that run would have written it
    return other


@pytest.mark.parametrize("how", ["symlink", "renamed", "copied"])
def test_a_checkpoint_that_is_not_the_run_s_own_is_refused_by_resume(run, how, capsys, tmp_path):
    import shutil

    from asyncrl.pipelines.checkpoints import checkpoint as ckpt

    _, out = run
    mine = tmp_path / "mine"
    shutil.copytree(out, mine)
    own = ckpt.latest_checkpoint(mine)
    theirs = ckpt.latest_checkpoint(_other_run(out, tmp_path))
    shutil.rmtree(own)
    if how == "symlink":  # another run's checkpoint put in place by a link
        own.symlink_to(theirs, target_is_directory=True)
        want = f"checkpoint {str(own)!r} leads to {str(theirs)!r}, outside {str(own.parent)!r}"
    elif how == "renamed":  # a checkpoint of this run under a later step's name (the newest, so resume takes it)
        step = ckpt.read_state(ckpt.latest_checkpoint(out))["step"]
        own = own.with_name("step_999999")
        shutil.copytree(ckpt.latest_checkpoint(out), own)
        want = f"checkpoint {str(own)!r} is named for step 999999 but its state.json is at step {step}"
    else:  # another run's checkpoint copied in
        shutil.copytree(theirs, own)
        want = f"checkpoint {str(own)!r} was written by another run: its fingerprint"
    assert main(["train", "--resume", str(mine), "trainer.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], err
