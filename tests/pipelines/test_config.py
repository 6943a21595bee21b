"""Config loading and validation: every mistake is a clear ConfigError before any worker starts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.job.config import ConfigError, JobConfig, config_fingerprint
from asyncrl.pipelines.job.presets import load_config
from asyncrl.pipelines.job.presets import grpo_toy, ppo_toy, tiny_test


def test_presets_are_valid_configs():
    for preset in (grpo_toy, ppo_toy, tiny_test):
        assert isinstance(preset().validate(), JobConfig)


def test_yaml_then_overrides_apply_in_order(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  steps: 7\n  max_staleness: 2\nactor:\n  lr: 0.01\n  betas: [0.8, 0.9]\n")
    cfg = load_config(f, ["trainer.steps=9", "rollout.temperature=0.5", "trainer.output_dir=out"])
    assert (cfg.trainer.steps, cfg.trainer.max_staleness, cfg.actor.lr) == (9, 2, 0.01)
    assert cfg.actor.betas == (0.8, 0.9)
    assert cfg.rollout.temperature == 0.5 and cfg.trainer.output_dir == "out"


def test_exponent_numbers_without_a_dot_are_floats_in_overrides_and_files(tmp_path):
    """A float field takes ``2e-4`` (YAML 1.2, Python), which PyYAML (YAML 1.1) reads as the string ``'2e-4'``."""
    f = tmp_path / "run.yaml"
    f.write_text("actor:\n  lr: 1e-5\n  weight_decay: 1E+0\n")
    cfg = load_config(f, [])
    assert (cfg.actor.lr, cfg.actor.weight_decay) == (1e-5, 1.0)
    cfg = load_config(None, ["actor.lr=2e-4", "critic.lr=+3e-6", "actor.betas=[9e-1, 0.95]"])
    assert (cfg.actor.lr, cfg.critic.lr, cfg.actor.betas) == (2e-4, 3e-6, (0.9, 0.95))
    assert load_config(None, ["trainer.output_dir=1e3x"]).trainer.output_dir == "1e3x"  # not a number: a string
    with pytest.raises(ConfigError, match=r"trainer.steps must be an integer, got .1e3."):
        load_config(None, ["trainer.steps=1e3"])


def test_yaml_booleans_read_as_the_choice_they_spell(tmp_path):
    """YAML 1.1 reads ``off`` as False: a choice whose one "off"-like spelling is ``off`` gets it back,
    in an override and in a file alike; a choice without such a spelling still refuses the boolean."""
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  partial_rollout: off\n")
    assert load_config(f, []).rollout.partial_rollout == "off"
    assert load_config(None, ["rollout.partial_rollout=off"]).rollout.partial_rollout == "off"
    assert load_config(None, ["rollout.partial_rollout=recompute"]).rollout.partial_rollout == "recompute"
    with pytest.raises(ConfigError, match="trainer.rollout_weights must be one of"):
        load_config(None, ["trainer.rollout_weights=off"])


@pytest.mark.parametrize("override, message", [
    ("trainer.stepz=3", "unknown config key 'trainer.stepz'; did you mean 'steps'"),
    ("bogus.x=1", "unknown config key 'bogus'"),
    ("trainer=3", "must be a mapping|is a section"),
    ("trainer.steps.x=1", "is a value, not a section"),
    ("trainer.steps=many", "trainer.steps must be an integer"),
    ("trainer.colocated=maybe", "must be true or false"),
    ("algorithm.name=dqn", r"must be one of \['grpo', 'ppo'\]"),
    ("trainer.steps", "is not key=value"),
    ("trainer.steps=0", "trainer.steps must be >= 1"),
    ("trainer.batch_size=60", "not divisible by algorithm.group_size=8"),
    ("trainer.max_staleness=-1", "max_staleness must be >= 0"),
    ("data.task=chess", "data.task 'chess' is unknown"),
    ("trainer.train_workers=3", "the train pool has 3 workers but a step has 8 prompts"),
    ("trainer.rollout_workers=3", "the rollout pool has 3 workers but a step has 8 prompts"),  # batch mode
    # off-policy correction and loss conventions
    ("actor.rollout_correction.mode=magic", r"actor.rollout_correction.mode must be one of \['auto', 'none', 'tis'"),
    ("actor.rollout_correction.rollout_is_threshold=0", "rollout_is_threshold must be > 0, got 0.0"),
    ("actor.rollout_correction.rollout_is_threshold=-2.5", "rollout_is_threshold must be > 0, got -2.5"),
    ("actor.rollout_correction.rollout_is=word", r"rollout_is must be one of \['token', 'sequence'\]"),
    ("actor.temperature=0.7", "actor.temperature=0.7 differs from rollout.temperature=1.0"),
    ("rollout.temperature=0", "rollout.temperature=0.0: training needs a sampling temperature > 0"),
    ("actor.loss_agg_mode=token-sum", "actor.loss_agg_mode must be one of"),
    ("actor.kl_loss_type=k4", "kl_loss_type must be one of"),
    ("actor.clip_ratio_c=1.0", "actor.clip_ratio_c must be > 1, got 1.0"),
    ("actor.mini_batch_size=0", "actor.mini_batch_size must be >= 1, got 0"),
])
def test_bad_settings_are_rejected_with_the_key_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_files_mapping_valued_field_is_its_value_and_an_optional_section_merges(tmp_path):
    """``reward.fn_kwargs`` (a free-form mapping) takes any keys from a file, replacing the preset's whole, as
    an override's value would; a section, optional or not, still merges key by key and names an unknown key."""
    f = tmp_path / "run.yaml"
    base = grpo_toy()
    base.reward.fn_kwargs = {"method": "flexible", "format_score": 0.0}
    base.reward.model = base.model
    f.write_text("reward:\n  fn_kwargs: {gate: /tmp/g, hold_at: 6}\n  model: {hidden_size: 48}\n"
                 "rollout:\n  episode_kwargs: {max_turns: 2}\n")
    cfg = load_config(f, base=base)
    assert cfg.reward.fn_kwargs == {"gate": "/tmp/g", "hold_at": 6}
    assert cfg.rollout.episode_kwargs == {"max_turns": 2}
    assert (cfg.reward.model.hidden_size, cfg.reward.model.num_layers) == (48, base.model.num_layers)
    f.write_text("reward:\n  model: {hidden_sise: 48}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'reward.model.hidden_sise'; did you mean 'hidden_size'"):
        load_config(f, base=base)


def test_unknown_yaml_key_is_rejected(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("trainer:\n  stepss: 3\n")
    with pytest.raises(ConfigError, match="trainer.stepss"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_pools_that_do_not_fit_the_cluster_are_rejected():
    cfg = grpo_toy()
    cfg.trainer.rollout_workers, cfg.trainer.train_workers, cfg.trainer.cpus_per_worker = 2, 2, 1.0
    cfg.validate(cluster_cpus=4)
    with pytest.raises(ConfigError, match="pools need 4 CPUs .* the cluster has 3"):
        cfg.validate(cluster_cpus=3)


def test_fingerprint_ignores_run_length_and_reporting_but_not_the_math():
    a, b = grpo_toy(), grpo_toy()
    b.trainer.steps, b.trainer.output_dir, b.trainer.plot = 500, "elsewhere", False
    assert config_fingerprint(a) == config_fingerprint(b)
    b.actor.lr = 0.1
    assert config_fingerprint(a) != config_fingerprint(b)


def test_cli_reports_config_errors_with_exit_status_2(capsys):
    assert main(["train", "trainer.batch_size=12"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert main(["train", "--resume", "/definitely/not/here"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--print-config", "trainer.steps=3"]) == 0
    assert "steps: 3" in capsys.readouterr().out


def test_off_policy_correction_is_on_by_default_exactly_when_rollout_may_run_ahead():
    cfg = grpo_toy()
    assert cfg.trainer.max_staleness == 1 and cfg.correction == "tis"
    cfg.trainer.max_staleness = 0
    assert cfg.correction == "none"
    cfg.actor.rollout_correction.mode = "decoupled"
    assert cfg.correction == "decoupled"


def test_bad_correction_settings_in_code_are_config_errors_too():
    cfg = grpo_toy()
    cfg.actor.rollout_correction.mode = "magic"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"^actor.rollout_correction.mode must be one of \['auto', 'none', 'tis', 'decoupled'\], got 'magic'$"):
        cfg.validate()
    cfg = grpo_toy()
    cfg.actor.rollout_correction.mode, cfg.actor.rollout_correction.rollout_is_threshold = "decoupled", 1.0
    with pytest.raises(ConfigError, match="must be > 1 for mode='decoupled'"):
        cfg.validate()
    cfg = grpo_toy()
    cfg.trainer.train_workers, cfg.actor.mini_batch_size = 2, 9
    with pytest.raises(ConfigError, match="actor: mini_batch_size=9 must be a positive multiple of the 2 training"):
        cfg.validate()


def test_the_workers_get_the_rollout_temperature():
    cfg = load_config(None, ["rollout.temperature=0.6"])
    assert cfg.actor.temperature is None and cfg.worker_actor().temperature == 0.6
    assert load_config(None, ["rollout.temperature=0.6", "actor.temperature=0.6"]).worker_actor().temperature == 0.6


# ---- the rollout section: every check is a ConfigError at validate() --------------------------------


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("overrides, line", [
    (["rollout.episode=no_such"],
     "rollout.episode: no episode or environment named 'no_such'; known: ["),
    (["rollout.episode=asyncrl_test_episodes_mod:missing_fn"],
     "rollout.episode: episode 'asyncrl_test_episodes_mod:missing_fn' cannot be imported (AttributeError: module "
     "'asyncrl_test_episodes_mod' has no attribute 'missing_fn'); give 'package.module:function' of an importable "
     "module"),
    (["rollout.episode=calculator", "rollout.episode_kwargs={env_kwargs: {depth: 3}}"],
     "rollout.episode_kwargs: environment 'calculator' has no option 'depth' (env_kwargs); it accepts ['tools']"),
    (["rollout.pause_deadline_s=0"], "rollout.pause_deadline_s must be > 0 seconds, got 0.0"),
    (["rollout.chunk_tokens=0"], "rollout.chunk_tokens must be >= 1, got 0"),
    (["rollout.partial_rollout=keep", "rollout.sync_policy=abort"],
     "rollout.partial_rollout='keep' continues generations across a weight update and sync_policy='abort' throws "
     "them away; use sync_policy='wait' with partial rollout, or partial_rollout='off' with 'abort'"),
    (["trainer.colocated=true", "rollout.sleep_level=3"], "rollout.sleep_level must be 0, 1 or 2, got 3"),
])
def test_bad_rollout_values_exit_2_with_one_line_naming_the_key(overrides, line, capsys, tmp_path, monkeypatch):
    (tmp_path / "asyncrl_test_episodes_mod.py").write_text("async def episode(llm, sample):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", *overrides]) == 2
    assert _one_line(capsys).startswith(f"asyncrl train: config error: {line}")


def test_bad_rollout_values_set_in_python_on_a_preset_fail_validate():
    from asyncrl.roles import EpisodeConfigError

    cfg = grpo_toy()
    cfg.rollout.pause_deadline_s = 0
    with pytest.raises(ConfigError, match=r"^rollout.pause_deadline_s must be > 0 seconds, got 0.0$"):
        cfg.validate()
    cfg = grpo_toy()
    cfg.rollout.episode = "no_such"
    with pytest.raises(ConfigError, match=r"^rollout.episode: no episode or environment named 'no_such'") as info:
        cfg.validate()
    assert isinstance(info.value.__cause__, EpisodeConfigError)
    cfg = grpo_toy()
    cfg.rollout.max_episodes_in_flight = "many"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"^rollout.max_episodes_in_flight must be an integer, got 'many'$"):
        cfg.validate()


@dataclass(kw_only=True)
class _Checked:
    n: int = 1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass(kw_only=True)
class _Outer:
    inner: _Checked = field(default_factory=_Checked)


def test_a_config_whose_constructor_refuses_a_value_is_a_config_error_naming_the_section():
    from asyncrl.pipelines import configlib

    with pytest.raises(ConfigError, match=r"^inner: n must be >= 1, got 0$"):
        configlib.apply_overrides(_Outer(), ["inner.n=0"])


# ---- defaults that follow the mode ------------------------------------------------------------------


def test_streaming_alone_validates_and_loads_the_latest_weights():
    cfg = load_config(None, ["trainer.rollout_mode=stream"])
    assert cfg.trainer.rollout_weights == "auto" and cfg.trainer.weights_choice() == "latest"
    assert grpo_toy().trainer.weights_choice() == "fixed_lag"  # batch mode: auto is fixed_lag
    with pytest.raises(ConfigError, match=r"trainer.rollout_weights='fixed_lag' pins batch t to version "
                                          r"t - max_staleness"):
        load_config(None, ["trainer.rollout_mode=stream", "trainer.rollout_weights=fixed_lag"])


def test_auto_rollout_weights_keep_the_fingerprint_of_what_they_resolve_to():
    """A run saved before ``auto`` (``fixed_lag`` in batch mode, ``latest`` in stream mode) resumes."""
    for mode, old in (("batch", "fixed_lag"), ("stream", "latest")):
        a, b = grpo_toy(), grpo_toy()
        a.trainer.rollout_mode = b.trainer.rollout_mode = mode
        b.trainer.rollout_weights = old
        assert config_fingerprint(a) == config_fingerprint(b)
        b.trainer.rollout_weights = "latest" if old == "fixed_lag" else "fixed_lag"
        assert config_fingerprint(a) != config_fingerprint(b)


@pytest.mark.parametrize("overrides, line", [
    (["trainer.rollout_placement=[2]"],
     "trainer.rollout_placement=[2] places 2 workers but trainer.rollout_workers=1; make them add up"),
    (["trainer.train_workers=2", "trainer.train_placement=[1, 2]"],
     "trainer.train_placement=[1, 2] places 3 workers but trainer.train_workers=2; make them add up"),
    (["trainer.train_placement=[]"],
     "trainer.train_placement must be a non-empty list of positive worker counts per node, got []"),
    (["trainer.rollout_placement=[1, 0]", "trainer.rollout_workers=1"],
     "trainer.rollout_placement[1] must be a positive worker count (one per node), got 0"),
    (["trainer.rollout_placement=[x]"], "trainer.rollout_placement"),
    (["trainer.colocated=true", "trainer.train_placement=[1]"],
     "trainer.train_placement places a pool of its own, but trainer.colocated=true puts both roles in one pool"),
    (["trainer.rollout_resources={roll: 1}"],
     "trainer.rollout_resources needs pools of their own: set trainer.rollout_placement or trainer.train_placement"),
    (["trainer.rollout_placement=[1]", "trainer.train_resources={CPU: 1}"],
     "trainer.train_resources gives each worker custom Ray resources as positive amounts"),
    (["trainer.rollout_placement=[1]", "trainer.rollout_resources={roll: 0}"],
     "trainer.rollout_resources.roll must be a positive amount of the custom Ray resource (CPUs and GPUs: "
     "cpus_per_worker, gpus_per_worker), got 0.0"),
    (["trainer.restart.placement_wait_s=0"], "trainer.restart.placement_wait_s must be a positive number of seconds"),
])
def test_bad_placements_exit_2_with_one_line_naming_the_key(overrides, line, capsys):
    assert main(["train", *overrides]) == 2
    assert _one_line(capsys).startswith(f"asyncrl train: config error: {line}")


def test_placements_give_each_pool_its_own_placement_groups_and_the_default_keeps_one():
    from asyncrl.pipelines.run.build import run_pools

    default = grpo_toy()
    (pool,) = run_pools(default)  # today's layout: one pool on one node, split between the two
    assert pool.bundles_per_node == [default.trainer.rollout_workers + default.trainer.train_workers]
    cfg = load_config(None, ["trainer.train_workers=2", "trainer.rollout_placement=[1]", "trainer.train_placement=[1, 1]",
                             "trainer.rollout_resources={roll: 1}"])
    rollout, train = run_pools(cfg)
    assert (rollout.bundles_per_node, rollout.resources_per_bundle) == ([1], {"roll": 1.0})
    assert (train.bundles_per_node, train.resources_per_bundle) == ([1, 1], {})
    only_rollout = load_config(None, ["trainer.train_workers=2", "trainer.rollout_placement=[1]"])
    assert [p.bundles_per_node for p in run_pools(only_rollout)] == [[1], [2]]  # the other pool on one node
    # where the workers sit does not change what a step computes: a resume may move them
    assert config_fingerprint(cfg) == config_fingerprint(load_config(None, ["trainer.train_workers=2"]))
