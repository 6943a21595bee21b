"""Episodes, environments and tools: the batch layout of a multi-turn rollout, the stop reasons, tools
that fail safely, and the errors of a malformed trajectory or a bad config.

The environment-loop tests drive :func:`environment_episode` with a scripted engine (fixed model turns)
so each stop reason is exact; the layout tests run real episodes on an in-process RolloutWorker."""

from __future__ import annotations

import asyncio
import traceback

import pytest
import torch

from asyncrl.roles import PolicyWorker, RewardWorker, RolloutConfig, RolloutWorker, tiny_tokenizer
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.engines.batcher import Generation
from asyncrl.roles.agentic.environments import (Calculator, Environment, StepResult, class_fraction, environment_episode,
                                        register_environment)
from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory, register_episode
from asyncrl.roles.errors import EpisodeConfigError, EpisodeError, TrajectoryError
from asyncrl.roles.agentic.tools import Tool, call_tool, tool

TOK = tiny_tokenizer()


def scripted_llm(turns: list[str], R: int = 200) -> LLM:
    """An LLM whose model turns are `turns` (log-prob -0.5 and version 3 per token)."""
    it = iter(turns)

    async def submit(ids: list[int], params: SamplingParams) -> Generation:
        t = TOK.encode(next(it))[:params.max_new_tokens]
        return Generation(t, [-0.5] * len(t), "length", versions=[3] * len(t))

    return LLM(submit, TOK, SamplingParams(max_new_tokens=16, seed=0), R)


SAMPLE = Sample(TOK.encode("q:"), prompt="q:", answer="391")


@register_environment("test_never_done")
class NeverDone(Environment):
    async def step(self, action: str) -> StepResult:
        return StepResult(observation=" no", reward=0.25)


# ---- stop reasons ------------------------------------------------------------------------------


async def test_an_episode_that_is_never_done_ends_at_max_turns():
    traj = await environment_episode(scripted_llm(["ab", "cd", "ef", "gh"]), SAMPLE, env=NeverDone(), max_turns=3)
    assert traj.stop_reason == "max_turns" and len(traj.turns) == 3 and traj.reward == 0.75
    no = TOK.encode(" no")
    assert traj.response_ids == TOK.encode("ab") + no + TOK.encode("cd") + no + TOK.encode("ef") + no
    assert traj.response_mask == [1, 1] + [0] * len(no) + [1, 1] + [0] * len(no) + [1, 1] + [0] * len(no)
    assert traj.versions == [3, 3] + [-1] * len(no) + [3, 3] + [-1] * len(no) + [3, 3] + [-1] * len(no)


async def test_an_episode_that_outgrows_its_length_ends_at_max_length():
    traj = await environment_episode(scripted_llm(["abcd"] * 10, R=9), SAMPLE, env=NeverDone(), max_turns=10)
    assert traj.stop_reason == "max_length" and len(traj.response_ids) == 9
    assert traj.response_mask == [1, 1, 1, 1] + [0] * 3 + [1, 1]  # the second turn got the 2 tokens left


async def test_a_calculator_call_becomes_a_result_observation_and_the_answer_ends_the_episode():
    traj = await environment_episode(scripted_llm(["<calc>17*23</calc>", "Answer: 391"]), SAMPLE, env=Calculator())
    env_tokens = [t for t, m in zip(traj.response_ids, traj.response_mask) if not m]
    assert TOK.decode(env_tokens) == "<result>391</result>"
    assert traj.stop_reason == "done" and traj.reward == 1.0 and traj.metrics == {}
    assert [t.get("tool") for t in traj.turns] == ["calc", None]


# ---- tools fail safely -------------------------------------------------------------------------


async def boom(expression: str) -> str:
    return str(1 // 0)


async def hang(expression: str) -> str:
    await asyncio.Event().wait()  # never set: only the deadline ends this call
    return "unreachable"


async def test_a_tool_that_raises_becomes_an_observation_and_is_counted():
    r = await call_tool(Tool("boom", boom), "1")
    assert r == type(r)("<error>tool boom failed: ZeroDivisionError: integer division or modulo by zero</error>",
                        "ZeroDivisionError")
    traj = await environment_episode(scripted_llm(["<boom>1</boom>", "Answer: 3"]), SAMPLE,
                                     env=Calculator(tools=[Tool("boom", boom)]))
    env_text = TOK.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert env_text.startswith("<error>tool boom failed: ZeroDivisionError")
    assert traj.metrics == {"tool_errors": 1.0} and traj.stop_reason == "done" and traj.reward == 0.0


async def test_a_tool_that_hangs_hits_its_deadline_and_becomes_an_observation():
    r = await call_tool(Tool("hang", hang, deadline_s=0.05), "1")
    assert r.observation == "<error>tool hang timed out after 0.05s</error>" and r.error == "timeout"
    traj = await environment_episode(scripted_llm(["<hang>1</hang>", "391"]), SAMPLE,
                                     env=Calculator(tools=[Tool("hang", hang, deadline_s=0.05)]))
    assert traj.metrics == {"tool_errors": 1.0} and traj.reward == 1.0 and len(traj.turns) == 2


# ---- configuration errors before any worker starts ----------------------------------------------


def test_an_unknown_environment_is_a_config_error_that_lists_the_known_ones():
    with pytest.raises(EpisodeConfigError, match=r"^RolloutConfig\.episode: no episode or environment named 'chess'; "
                                                 r"known: \[.*'calculator'"):
        RolloutConfig(episode="chess").validate()
    with pytest.raises(EpisodeConfigError, match="^RolloutConfig.episode: episode 'no_such_module:episode' cannot be "
                                                 "imported"):
        RolloutConfig(episode="no_such_module:episode").validate()


def test_a_tool_that_is_not_async_is_a_config_error_naming_it():
    def slow_sum(expression: str) -> str:
        return expression

    with pytest.raises(EpisodeConfigError, match="^RolloutConfig.episode_kwargs: tool 'slow_sum'.*is not async"):
        RolloutConfig(episode="calculator", episode_kwargs={"tools": [slow_sum]}).validate()
    with pytest.raises(EpisodeConfigError, match="tool 'slow_sum'.*is not async"):
        tool("slow_sum")(slow_sum)  # type: ignore[arg-type]
    with pytest.raises(EpisodeConfigError, match="no tool named 'abacus'"):
        RolloutConfig(episode="calculator", episode_kwargs={"tools": ["abacus"]}).validate()


@register_environment("test_windy")
class Windy(Environment):
    def __init__(self, wind: float = 0.0, *, gusts: int = 0) -> None:
        self.wind, self.gusts = wind, gusts

    async def step(self, action: str) -> StepResult:
        return StepResult(done=True)


def test_an_unknown_environment_option_is_a_config_error_naming_it_and_the_accepted_ones():
    cfg = RolloutConfig(episode="test_windy", episode_kwargs={"env_kwargs": {"wind": 2.0, "colour": "red"}})
    with pytest.raises(EpisodeConfigError) as info:
        cfg.validate()
    assert str(info.value) == ("RolloutConfig.episode_kwargs: environment 'test_windy' has no option 'colour' "
                               "(env_kwargs); it accepts ['gusts', 'wind']")
    with pytest.raises(EpisodeConfigError, match=r"environment 'calculator' has no option 'depth' \(env_kwargs\); "
                                                 r"it accepts \['tools'\]"):
        RolloutConfig(episode="calculator", episode_kwargs={"env_kwargs": {"depth": 3}}).validate()
    with pytest.raises(EpisodeConfigError, match=r"environment 'test_windy' takes no tools"):
        RolloutConfig(episode="test_windy", episode_kwargs={"tools": ["calc"]}).validate()
    with pytest.raises(EpisodeConfigError, match=r"unknown episode_kwargs \['turns'\]; it takes \['env_kwargs', "
                                                 r"'max_turns', 'tokens_per_turn', 'tools'\]"):
        RolloutConfig(episode="test_windy", episode_kwargs={"turns": 3}).validate()
    RolloutConfig(episode="test_windy", episode_kwargs={"env_kwargs": {"wind": 1.0, "gusts": 2}}).validate()


# ---- episodes on the rollout worker ---------------------------------------------------------------


@register_episode("test_bad_mask")
async def bad_mask(llm: LLM, sample: Sample) -> Trajectory:
    traj = llm.start(sample)
    await llm.generate(traj, max_new_tokens=3)
    traj.response_mask.append(1)
    return traj


@register_episode("test_no_log_probs")
async def no_log_probs(llm: LLM, sample: Sample) -> Trajectory:
    traj = llm.start(sample)
    await llm.generate(traj, max_new_tokens=3)
    traj.log_probs[1] = None
    return traj


@register_episode("test_raises")
async def raises(llm: LLM, sample: Sample) -> Trajectory:
    traj = llm.start(sample)
    await llm.generate(traj, max_new_tokens=2)
    raise KeyError("no such state")


@pytest.fixture(scope="module")
def rollout(model_config):
    return RolloutWorker(model_config, RolloutConfig(max_new_tokens=22, episode="char_class_retry",
                                                     episode_kwargs={"max_turns": 2, "tokens_per_turn": 4}))


@pytest.mark.parametrize("episode, field", [("test_bad_mask", "response_mask"), ("test_no_log_probs", "log_probs")])
async def test_a_malformed_trajectory_is_an_error_naming_the_episode_and_the_field(rollout, prompt_batch, episode,
                                                                                    field):
    with pytest.raises(TrajectoryError, match=rf"episode '{episode}' \(row \d\): field '{field}'"):
        await rollout.generate_episodes(prompt_batch(n=2), episode=episode)


async def test_an_episode_that_raises_fails_the_call_with_one_error_naming_it_and_the_row(rollout, prompt_batch):
    with pytest.raises(EpisodeError, match=r"episode 'test_raises' \(row \d\) raised KeyError: 'no such state'") as info:
        await rollout.generate_episodes(prompt_batch(n=2), episode="test_raises")
    cause = info.value.__cause__  # the user's own exception, so its traceback is printed with the error
    assert type(cause) is KeyError and cause.args == ("no such state",)
    assert any(frame.name == "raises" for frame in traceback.extract_tb(cause.__traceback__))


async def test_episodes_return_the_generate_layout_with_environment_tokens_masked(rollout, model_config, prompt_batch):
    batch = prompt_batch(n=3, repeat=2)
    out = await rollout.generate(batch, seed=1)
    P, R = batch["prompt_ids"].shape[1], 22
    assert out["response_ids"].shape == (6, R) and out["uid"].tolist() == [0, 0, 1, 1, 2, 2]
    mask, attn = out["response_mask"], out["attention_mask"][:, P:]
    for b in range(6):
        n_obs = int(attn[b].sum()) - 8 if out["num_turns"][b] == 2 else 0
        if out["num_turns"][b] == 2:  # guess, feedback (mask 0), correction
            assert mask[b].tolist() == [1] * 4 + [0] * n_obs + [1] * 4 + [0] * (R - 8 - n_obs)
            obs = out["response_ids"][b, 4:4 + n_obs].tolist()
            assert TOK.decode(obs).endswith(", again:")
        assert (attn[b][mask[b].bool()] == 1).all() and (out["rollout_log_probs"][b][~mask[b].bool()] == 0).all()
        assert (out["token_versions"][b][mask[b].bool()] == 0).all()
        # the episode's reward is the environment's mean turn score of the decoded model turns
        turns = [out["response_ids"][b, :4].tolist(), out["response_ids"][b, 4 + n_obs:8 + n_obs].tolist()]
        scores = [class_fraction(TOK.decode(t), out["answer"][b], 4) for t in turns[:int(out["num_turns"][b])]]
        want = (scores[0] + 1.0) / 2 if scores[0] == 1.0 else sum(scores) / 2
        assert float(out["episode_reward"][b]) == pytest.approx(want, abs=1e-6)
    assert out["stop_reason"] == ["done"] * 6
    # the reward stage takes the episodes' rewards; the policy recomputes the behaviour log-probs of the
    # model tokens with the environment tokens as context
    assert torch.equal(RewardWorker().compute_reward(out)["scores"], out["episode_reward"])
    old = PolicyWorker(model_config).compute_log_prob(out)["old_log_probs"]
    m = mask.bool()
    torch.testing.assert_close(old[m], out["rollout_log_probs"][m], atol=1e-5, rtol=0)


GATE: dict[str, asyncio.Event] = {}


@register_episode("test_waits_between_turns")
async def waits_between_turns(llm: LLM, sample: Sample) -> Trajectory:
    traj = llm.start(sample)
    await llm.generate(traj, max_new_tokens=2)
    GATE["started"].set()
    await GATE["go"].wait()  # the test holds the episode in flight here
    traj.observe(llm.encode(" ok:"))
    await llm.generate(traj, max_new_tokens=2)
    return traj


async def test_a_weight_update_waits_for_the_episodes_in_flight_and_the_next_ones_carry_its_version(
        model_config, prompt_batch):
    from asyncrl.roles import PolicyWorker

    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=12))
    GATE.update(started=asyncio.Event(), go=asyncio.Event())
    episodes = asyncio.ensure_future(rollout.generate_episodes(prompt_batch(n=2), episode="test_waits_between_turns"))
    await GATE["started"].wait()
    weights = PolicyWorker(model_config).export_weights()
    update = asyncio.ensure_future(rollout.update_weights((1, weights[1])))
    await asyncio.sleep(0)
    assert not update.done()
    GATE["go"].set()
    out = await episodes
    receipt = await update
    assert receipt["version"] == 1 and receipt["waited"] == 1
    assert out["version"].tolist() == [0, 0] and set(out["token_versions"][out["response_mask"].bool()].tolist()) == {0}
    GATE["go"].set()
    after = await rollout.generate_episodes(prompt_batch(n=2), episode="test_waits_between_turns")
    assert after["version"].tolist() == [1, 1]


async def test_chat_messages_need_a_tokenizer_with_a_chat_template():
    with pytest.raises(ValueError, match="no chat template; pass token ids"):
        await scripted_llm(["x"]).generate([{"role": "user", "content": "hi"}])


def test_chat_messages_become_the_templates_token_ids():
    from asyncrl.roles.modeling.models import load_tokenizer

    tok = load_tokenizer("qwen2")
    llm = LLM(None, tok, SamplingParams(max_new_tokens=2), 8)  # type: ignore[arg-type]
    assert llm.chat([{"role": "user", "content": "hi"}]) == tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
