"""Checks of the worker sections of a :class:`~asyncrl.pipelines.job.config.JobConfig`, run in the
controller before Ray or any worker starts.

Each worker validates its own config when it is constructed, but that happens after Ray and
the placement groups are up, and a constructor error reaches the user as a remote traceback.
These checks repeat every one of those rules that can be decided in the controller -- names
that must be registered (reward functions, generation engines, tasks), paths that must exist
and values that must fit each other (value ranges are declared next to each field and checked
by ``JobConfig.validate``: :mod:`asyncrl.roles.fields`) -- so ``asyncrl train`` (and
``--print-config``) reject a bad value in well under a second with a :class:`ConfigError` that
names the key and how to fix it.

Registries are consulted by name in the controller: a reward function or engine registered
in a module that only the workers import is not visible here; import that module before
building the trainer (the worker classes passed as ``worker_overrides`` are imported anyway).
"""

from __future__ import annotations

import os
from typing import Any

from asyncrl.pipelines.configlib import ConfigError
from asyncrl.roles.engines import engine_names
from asyncrl.roles.engines.base import engine_options
from asyncrl.roles.errors import TokenizerNotFoundError
from asyncrl.roles.modeling.models import _TOKENIZER_FILES, has_chat_template, is_gguf_spec, qwen2_tokenizer_dir
from asyncrl.roles.scoring.reward import reward_fn_names
from asyncrl.roles.modeling.strategy import layer_classes

__all__ = ["check_worker_sections"]


def _check_tokenizer(key: str, spec: str | None) -> None:
    if spec is not None and is_gguf_spec(spec):
        return  # a GGUF file's own tokenizer: checked when the model is converted, before workers start
    if spec is None or spec in ("tiny", "qwen2"):
        if spec == "qwen2":
            try:
                qwen2_tokenizer_dir()
            except TokenizerNotFoundError as e:
                raise ConfigError(f"{key}='qwen2': {e}") from None
        return
    if not os.path.isdir(spec):
        raise ConfigError(f"{key}={spec!r}: no such directory; use 'tiny', 'qwen2' or a local directory "
                          "holding tokenizer files (tokenizer.json, tokenizer_config.json, ...)")


def _check_model(key: str, m: Any) -> None:
    path = getattr(m, "path", None)
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"{key}.path={path!r} does not exist; give a local model directory (config.json + "
                              "weights), or leave it null to build a tiny model from the config")
        if os.path.isdir(path) and not any(
                f == "config.json" or f.endswith(".gguf") for f in os.listdir(path)):
            raise ConfigError(f"{key}.path={path!r} holds no config.json (nor a .gguf file), so it is not a model "
                              "directory; save one with model.save_pretrained(path)")
        if os.path.isdir(path) and getattr(m, "tokenizer", None) is None:
            if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
                raise ConfigError(f"{key}.path={path!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                                  "save it there with tokenizer.save_pretrained(path), or name one with "
                                  f"{key}.tokenizer=DIR")
    _check_tokenizer(f"{key}.tokenizer", getattr(m, "tokenizer", None))
    if path is None:  # a tiny model built from the config: its sizes (each within its Range) must make a model
        h, heads, kv = getattr(m, "hidden_size", 1), getattr(m, "num_heads", 1), getattr(m, "num_kv_heads", 1)
        if h % heads:
            raise ConfigError(f"{key}.hidden_size={h} is not divisible by {key}.num_heads={heads}")
        if heads % kv:
            raise ConfigError(f"{key}.num_heads={heads} is not divisible by {key}.num_kv_heads={kv}")
    threads = getattr(m, "num_threads", None)
    if threads is not None and threads != "follow" and not (
            isinstance(threads, int) and not isinstance(threads, bool) and threads >= 0):
        raise ConfigError(f"{key}.num_threads must be null (the worker's CPU share), 0 (every core of the machine), "
                          f"'follow' (the machine's cores split among the workers busy now) or a positive integer, "
                          f"got {threads!r}")


def _check_fsdp2(cfg: Any) -> None:
    """``strategy=fsdp2`` shards per decoder layer: a model directory's architecture must declare its layers
    (the built-in tiny models and GGUF models are Qwen2/Llama, which do)."""
    for k in ("actor", "critic"):
        if getattr(cfg, k).fsdp_offload and cfg.trainer.gpus_per_worker == 0 and (k == "actor" or cfg.algorithm.name == "ppo"):
            raise ConfigError(f"{k}.fsdp_offload=true keeps a GPU model's shards in CPU memory between uses, but the "
                              "training pool has no GPU (trainer.gpus_per_worker=0): they already are in CPU memory; "
                              f"set {k}.fsdp_offload=false")
    keys = [f"{k}.strategy" for k in ("actor", "critic") if getattr(cfg, k).strategy == "fsdp2"
            and (k == "actor" or cfg.algorithm.name == "ppo")]
    path = cfg.model.path
    if not keys or path is None or not os.path.isfile(os.path.join(path, "config.json")):
        return
    try:
        name, layers = layer_classes(path)
    except (KeyError, ValueError, OSError) as e:
        raise ConfigError(f"{keys[0]}=fsdp2 needs the model's architecture to find its decoder layers, but "
                          f"model.path={path!r} is not a causal LM transformers knows ({type(e).__name__}: "
                          f"{str(e)[:120]}); set {keys[0]}=ddp") from None
    if not layers:
        raise ConfigError(f"{keys[0]}=fsdp2 shards a model per decoder layer, but {name} (model.path={path!r}) "
                          f"declares none (transformers' _no_split_modules); set {keys[0]}=ddp")


def _check_token_budget(key: str, o: Any, cfg: Any) -> None:
    """A token budget below the longest row a batch can hold would fail the first update that meets one."""
    budget = getattr(o, "max_tokens_per_micro_batch", None)
    if budget is None:
        return
    prompt, new = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    longest = (prompt or 1) + new
    if budget < longest:
        rows = (f"data.max_prompt_length={prompt} + rollout.max_new_tokens={new}" if prompt
                else f"a one-token prompt + rollout.max_new_tokens={new}")
        raise ConfigError(f"{key}.max_tokens_per_micro_batch={budget} is smaller than the longest row a batch can "
                          f"hold ({rows} = {longest} tokens); set it to at least {longest}, or to null for "
                          f"micro-batches of {key}.micro_batch_size rows")


def _check_chat_template(key: str, m: Any) -> None:
    """The agent's gateway renders chat messages with the policy's chat template: its tokenizer must have one."""
    if has_chat_template(m) is not False:
        return
    which = (f"model.tokenizer={m.tokenizer!r}" if m.tokenizer is not None
             else f"model.tokenizer (null: the model's own, in {m.path!r})" if m.path is not None
             else "model.tokenizer (null: the tiny model's 'tiny')")
    raise ConfigError(f"{key} runs the agent against the gateway, which renders its chat messages with the policy's "
                      f"chat template, but {which} has none; set model.tokenizer=qwen2 or a model whose tokenizer "
                      "has a chat template")


def check_worker_sections(cfg: Any) -> None:
    """Raise :class:`ConfigError` for a value of `cfg`'s worker sections (``model``, ``rollout``,
    ``actor``, ``critic``, ``reward``) or ``algorithm`` that a worker would reject at start-up."""
    _check_model("model", cfg.model)
    r = cfg.rollout
    if r.engine not in engine_names():
        raise ConfigError(f"rollout.engine {r.engine!r} is not a registered engine; known: {engine_names()} "
                          "(add one with @asyncrl.roles.register_engine)")
    options = engine_options(r.engine)
    unknown = sorted(set(r.engine_kwargs) - set(options)) if options is not None else []
    if unknown:
        raise ConfigError(f"rollout.engine_kwargs: {unknown[0]!r} is not an option of the {r.engine!r} engine; it "
                          f"takes {options}")
    if r.model_dir is not None and not os.path.isdir(r.model_dir):
        raise ConfigError(f"rollout.model_dir={r.model_dir!r} does not exist; give a local model directory or null")
    max_pos = getattr(cfg.model, "max_position_embeddings", None)
    if cfg.model.path is None and isinstance(max_pos, int) and r.max_new_tokens >= max_pos:
        raise ConfigError(f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in the model's "
                          f"context of model.max_position_embeddings={max_pos}")
    _check_token_budget("actor", cfg.actor, cfg)
    if cfg.algorithm.name == "ppo":
        _check_token_budget("critic", cfg.critic, cfg)
    _check_fsdp2(cfg)
    w = cfg.reward
    if w.model is None:
        if ":" not in w.fn and w.fn not in reward_fn_names():  # a function by path: JobConfig._validate_reward
            raise ConfigError(
                f"reward.fn {w.fn!r} is not a registered reward function; registered: {reward_fn_names()}. "
                "Register yours with @asyncrl.roles.register_reward_fn(name) in a module imported before the "
                "trainer is built"
            )
    else:
        _check_model("reward.model", w.model)
    _check_tokenizer("reward.tokenizer", cfg.worker_reward().tokenizer if hasattr(cfg, "worker_reward") else w.tokenizer)
    if r.agent is not None:
        _check_chat_template("rollout.agent", cfg.model)
