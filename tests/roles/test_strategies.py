"""The training strategies on real Ray: ``fsdp2`` at 2 ranks trains like ``ddp`` at 2 ranks and like one rank, and a
weight sync from its shards gathers one unit at a time (measured).

Two colocated Ray processes hold a ddp policy, an fsdp2 policy, an fsdp2 critic and an fsdp2 reference
(gloo between them); the one-rank references run in this process. The batch's two shards hold very
different token counts, so an average of per-rank gradients (instead of their sum of global shares)
would not match.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import ray
import torch

import asyncrl
from asyncrl import Dispatch, register
from asyncrl.roles import (CheckpointFormatError, CriticWorker, OptimConfig, PolicyWorker, ReferenceWorker,
                           RolloutConfig, RolloutCorrectionConfig, RolloutWorker, open_weight_channel, sync_weights)
from asyncrl.roles.modeling.models import ModelConfig, tensor_checksum
from asyncrl.roles.functional import LOSS_AGG_MODES


class StrategyProbe(PolicyWorker):
    """The policy plus what the tests read: its loss mode setter and the bytes it holds."""

    @register(Dispatch.ONE_TO_ALL)
    def set_loss_agg_mode(self, mode: str) -> None:
        self.optim_config.loss_agg_mode = mode

    @register(Dispatch.ONE_TO_ALL)
    def held(self) -> dict:
        """Elements of parameters, gradients and optimizer state this rank holds, and whether they are shards."""
        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        params = [local(p) for p in self.model.parameters()]
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        optim = [local(v) for st in self.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": sum(t.numel() for t in params), "grads": sum(t.numel() for t in grads),
                "optim": sum(t.numel() for t in optim),
                "sharded": any(isinstance(p, DTensor) for p in self.model.parameters()),
                "all_sharded": all(isinstance(p, DTensor) for p in self.model.parameters())}

    @register(Dispatch.ONE_TO_ALL)
    def fail_next_update(self, where: str, micro: int) -> None:
        """The next update raises in its `micro`-th micro-batch (1-based), in the second decoder layer: on entering
        its forward (after FSDP2 gathered it), or in the backward (after the layers above it ran theirs)."""
        layer = [m for m in self.model.modules() if "DecoderLayer" in type(m).__name__][1]  # (FSDP renames it)
        seen = [0]

        def boom(*_):
            raise RuntimeError(f"injected failure in micro-batch {micro}'s {where}")

        def pre(module, args):
            seen[0] += torch.is_grad_enabled()
            if seen[0] == micro and where == "forward":
                handles[0].remove()
                boom()

        def post(module, args, output):
            if seen[0] == micro and where == "backward" and torch.is_grad_enabled():
                handles[0].remove()
                handles[1].remove()
                (output[0] if isinstance(output, tuple) else output).register_hook(boom)

        handles = [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]

    @register(Dispatch.ONE_TO_ALL)
    def unit_bytes(self) -> list[int]:
        """Bytes of each FSDP unit's own parameters whole (the root's, then each decoder layer's)."""
        from asyncrl.roles.modeling.lora import MergedWeights

        layout = self.weights.export_layout()  # (DTensor shards: numel() is the whole tensor's)
        sources = MergedWeights(self.model).sources if self._lora else {n: n for n in layout}  # the modules read
        return [sum(layout[n].numel() * layout[n].element_size() for n in keys)
                for _, keys in self.engine._per_unit(sources)]

    @register(Dispatch.ONE_TO_ALL)
    def sync_peak(self) -> dict[str, int]:
        """``stage_weights("object_store")`` twice (the first allocates rank 0's packed host buffer, kept across
        versions); of the second, the peak of the bytes the CPU allocator handed out beyond those live when it
        started, and what was still held when it returned. The torch profiler records each allocation and free of
        this thread with its bytes (FSDP2's storage resizes included): deterministic, unlike RSS."""
        from torch.profiler import ProfilerActivity, profile

        self.stage_weights("object_store")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            handle = self.stage_weights("object_store")
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        live = peak = 0
        for _, n in events:
            live += n
            peak = max(peak, live)
        return {"peak": peak, "held_after": live, "staged": 0 if handle is None else handle.nbytes}


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test module is not importable by workers

OPTIM = OptimConfig(lr=1e-3, micro_batch_size=3, max_grad_norm=0.01, kl_coef=0.1, kl_loss_type="low_var_kl",
                    entropy_coef=0.01, rollout_correction=RolloutCorrectionConfig(mode="tis", rollout_is_threshold=1.5))
FSDP2 = replace(OPTIM, strategy="fsdp2")
CRITIC = OptimConfig(lr=1e-3, micro_batch_size=3, max_grad_norm=0.01, strategy="fsdp2")
DEEP = ModelConfig(hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=256, seed=0,
                   device="cpu", dtype="float32", autocast="off", num_threads=1)
"""Many units, none of them most of the model: what a gather of one unit at a time is told from a gather of all."""


@pytest.fixture(scope="module")
async def ranks(ray_cluster, model_config):
    col = asyncrl.colocate({"ddp": (StrategyProbe, (model_config, OPTIM), {}),
                            "fsdp2": (StrategyProbe, (model_config, FSDP2), {}),
                            "resumed": (StrategyProbe, (model_config, FSDP2), {}),
                            "kept": (StrategyProbe, (model_config, replace(FSDP2, fsdp_reshard_after_forward=False,
                                                                            fsdp_reduce_every_micro_batch=True,
                                                                            optimizer_impl="fused")), {}),
                            # copies: workers unpickled from one object share it, and set_loss_agg_mode sets it
                            "failing": (StrategyProbe, (model_config, replace(FSDP2)), {}),
                            "failing_ddp": (StrategyProbe, (model_config, replace(OPTIM)), {}),
                            "critic": (CriticWorker, (model_config, CRITIC), {}),
                            "reference": (ReferenceWorker, (model_config,), {"strategy": "fsdp2",
                                                                             "micro_batch_size": 3}),
                            "deep": (StrategyProbe, (DEEP, FSDP2), {}),
                            "deep_lora": (StrategyProbe, (DEEP, replace(FSDP2, lora=replace(FSDP2.lora, rank=4))), {})},
                           world_size=2, name="strategies")
    await col.setup()
    try:
        yield col
    finally:
        await col.close()


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=lambda m: f"{what}, {k}: {m}")


async def test_fsdp2_at_two_ranks_trains_like_ddp_at_two_and_like_one_rank(ranks, model_config, uneven_batch):
    """Every loss_agg_mode in turn, two clipped AdamW steps each: the weights of the three stay within 1e-6."""
    one = StrategyProbe(model_config, replace(OPTIM, strategy="fsdp2"))  # one rank: the plain model either way
    _, start = one.export_weights()
    for mode in LOSS_AGG_MODES:
        one.set_loss_agg_mode(mode)
        await ranks["ddp"].set_loss_agg_mode(mode)
        await ranks["fsdp2"].set_loss_agg_mode(mode)
        await ranks["kept"].set_loss_agg_mode(mode)
        for _ in range(2):
            m1 = one.update(uneven_batch)
            md = await ranks["ddp"].update(uneven_batch)
            mf = await ranks["fsdp2"].update(uneven_batch)
            # no reshard after forward, a reduce-scatter per micro-batch, the fused AdamW on DTensor shards
            await ranks["kept"].update(uneven_batch)
            assert m1["grad_norm"] > OPTIM.max_grad_norm  # clipping is live
            for k, v in m1.items():
                assert md[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (mode, "ddp", k)
                assert mf[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (mode, "fsdp2", k)
            assert mf[0] == mf[1]  # metrics are of the whole batch on every rank
        v1, w1 = one.export_weights()
        vd, wd = await ranks["ddp"].export_weights()
        vf, wf = await ranks["fsdp2"].export_weights()
        assert v1 == vd == vf
        _close(w1, wd, f"ddp after {mode}")
        _close(w1, wf, f"fsdp2 after {mode}")
        _close(w1, (await ranks["kept"].export_weights())[1], f"fsdp2 kept, reducing each micro-batch, fused AdamW, "
                                                              f"after {mode}")
    assert max((w1[k] - start[k]).abs().max().item() for k in w1) > 5e-3  # the weights did move


async def test_a_rollout_loads_the_weights_gathered_from_fsdp2_shards_by_each_transport(ranks, model_config,
                                                                                      uneven_batch):
    """``sync_weights(verify=True)``: the rollout's loaded weights have the checksums the fsdp2 policy gathers, through
    the object store and through a collective channel (its snapshot staged in host memory)."""
    rollout = asyncrl.colocate({"rollout": (RolloutWorker, (model_config, RolloutConfig(max_new_tokens=2)), {})},
                               world_size=1, name="strategies-rollout")
    await rollout.setup()
    try:
        await ranks["fsdp2"].update(uneven_batch)
        version = (await ranks["fsdp2"].get_version())
        assert await sync_weights(ranks["fsdp2"], rollout["rollout"], verify=True) == version
        await ranks["fsdp2"].update(uneven_batch)
        await open_weight_channel(ranks["fsdp2"], rollout["rollout"], name="fsdp2-weights", timeout_s=60)
        assert await sync_weights(ranks["fsdp2"], rollout["rollout"], verify=True,
                                  transport="collective") == version + 1
        _, whole = await ranks["fsdp2"].export_weights()
        assert (await rollout["rollout"].weights_checksum())[0] == {k: tensor_checksum(v) for k, v in whole.items()}
    finally:
        await rollout.close()


async def test_a_step_that_raises_mid_micro_batch_leaves_nothing_behind_for_the_next(ranks, model_config,
                                                                                    uneven_batch):
    """Each rank runs two micro-batches per step (the first's gradient is summed over the ranks in the second's
    backward). A step raises in the second micro-batch's forward, then in its backward (some layers' gradients
    already reduce-scattered), then in the first micro-batch's backward: each fails, the version stays, and the
    next good step gives the weights and metrics of that good step alone, under fsdp2 and ddp."""
    one = StrategyProbe(model_config, OPTIM)
    expected = one.update(uneven_batch)
    _, weights = one.export_weights()
    for name in ("failing", "failing_ddp"):
        for where, micro in (("forward", 2), ("backward", 2), ("backward", 1)):
            await ranks[name].fail_next_update(where, micro)
            with pytest.raises(Exception, match=f"injected failure in micro-batch {micro}'s {where}"):
                await ranks[name].update(uneven_batch)
            assert await ranks[name].get_version() == 0
        metrics = await ranks[name].update(uneven_batch)
        for k, v in expected.items():
            assert metrics[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (name, k)
        _close(weights, (await ranks[name].export_weights())[1], f"{name}: a good step after failed ones")


async def test_fsdp2_holds_shards_only_between_calls(ranks, uneven_batch):
    """The last decoder layer and the root stay gathered from their forward to their backward (every unit with
    reshard_after_forward=false); a forward without autograd (log-probs) reshards them: what the weight sync, the
    checksums and a checkpoint read are shards."""
    for name in ("fsdp2", "kept"):
        await ranks[name].compute_log_prob(uneven_batch)
        assert [h["all_sharded"] for h in await ranks[name].held()] == [True, True], name
        await ranks[name].update(uneven_batch)
        assert [h["all_sharded"] for h in await ranks[name].held()] == [True, True], name


async def test_fsdp2_holds_half_of_the_replicated_model_per_rank(ranks, uneven_batch):
    await ranks["ddp"].update(uneven_batch)
    await ranks["fsdp2"].update(uneven_batch)
    ddp = await ranks["ddp"].held()
    fsdp = await ranks["fsdp2"].held()
    assert not ddp[0]["sharded"] and fsdp[0]["sharded"] and fsdp[1]["sharded"]
    for part in ("params", "grads", "optim"):
        assert fsdp[0][part] + fsdp[1][part] == ddp[0][part], part  # every element once, over the two ranks
        assert max(fsdp[0][part], fsdp[1][part]) <= 0.55 * ddp[0][part], part  # 1/2 of a replica (+10 %)


@pytest.mark.parametrize("policy", ["deep", "deep_lora"])
async def test_a_sync_from_fsdp2_shards_holds_one_unit_whole_at_a_time(ranks, policy):
    """Each rank stages the weights of an 8-layer policy for the object store: beyond what it held before, the sync
    peaks at one unit's all-gather buffer and its parameters copied out of it (with LoRA also the unit's merged
    weights and one adapter delta being added), about a quarter of the model; a gather of the model whole would need
    all of it. Nothing stays allocated after the sync but rank 0's packed buffer of the first one."""
    units = (await ranks[policy].unit_bytes())[0]
    whole, largest = sum(units), max(units)
    assert len(units) == 9 and largest < whole / 8  # the root and 8 layers
    bound = 2 * largest
    if policy == "deep_lora":
        bound += largest + 2 * 64 * 256 * 4  # the unit's merged weights, an MLP weight's delta B @ A and its sum
    peaks = await ranks[policy].sync_peak()
    for rank, p in enumerate(peaks):
        assert 0 < p["peak"] <= bound < whole / 2, (policy, rank, p, units)
        assert p["held_after"] == 0, (policy, rank, p)
    assert peaks[0]["staged"] == whole and peaks[1]["staged"] == 0  # rank 0 alone stages the whole payload


async def test_fsdp2_critic_and_reference_compute_what_one_rank_does(ranks, model_config, uneven_batch):
    one = CriticWorker(model_config, replace(CRITIC, strategy="ddp"))
    for _ in range(2):
        m1 = one.update(uneven_batch)
        m2 = await ranks["critic"].update(uneven_batch)
        for k, v in m1.items():
            assert m2[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    torch.testing.assert_close((await ranks["critic"].compute_values(uneven_batch))["values"],
                               one.compute_values(uneven_batch)["values"], rtol=0, atol=1e-6)
    ref1 = ReferenceWorker(model_config, micro_batch_size=3).compute_ref_log_prob(uneven_batch)
    ref2 = await ranks["reference"].compute_ref_log_prob(uneven_batch)
    torch.testing.assert_close(ref2["ref_log_probs"], ref1["ref_log_probs"], rtol=0, atol=1e-6)
    assert await ranks["reference"].weights_checksum() == ReferenceWorker(model_config).weights_checksum()


async def test_an_fsdp2_checkpoint_resumes_at_another_rank_count_and_trains_on_like_the_uninterrupted_run(
        ranks, model_config, uneven_batch, tmp_path):
    """2 ranks -> 1 rank -> 2 ranks: each load reshards (torch.distributed.checkpoint) and the next update
    gives the weights of the run that never stopped."""
    two = ranks["fsdp2"]
    await two.update(uneven_batch)
    (await two.save(str(tmp_path / "two")))
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["dcp", "meta.json"]
    one = StrategyProbe(model_config, FSDP2)
    version = one.load(str(tmp_path / "two"))
    v2, w2 = await two.export_weights()
    assert version == v2
    _close(one.export_weights()[1], w2, "loaded at one rank")  # the same weights ...
    one.update(uneven_batch)
    await two.update(uneven_batch)
    _close(one.export_weights()[1], (await two.export_weights())[1], "one step after 2 -> 1")  # ... and Adam state
    one.save(str(tmp_path / "one"))
    assert await ranks["resumed"].load(str(tmp_path / "one")) == [version + 1, version + 1]
    await ranks["resumed"].update(uneven_batch)
    await two.update(uneven_batch)
    _close((await ranks["resumed"].export_weights())[1], (await two.export_weights())[1], "one step after 1 -> 2")


def test_a_checkpoint_of_the_other_strategy_is_refused_naming_both(model_config, tmp_path):
    PolicyWorker(model_config, FSDP2).save(str(tmp_path / "sharded"))
    with pytest.raises(CheckpointFormatError, match=r"written with strategy='fsdp2'.*runs strategy='ddp'; resume "
                                                    r"with strategy='fsdp2'"):
        PolicyWorker(model_config, OPTIM).load(str(tmp_path / "sharded"))
    PolicyWorker(model_config, OPTIM).save(str(tmp_path / "whole"))
    with pytest.raises(CheckpointFormatError, match=r"written with strategy='ddp'.*runs strategy='fsdp2'"):
        PolicyWorker(model_config, FSDP2).load(str(tmp_path / "whole"))


def test_a_bad_strategy_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"strategy must be one of \['ddp', 'fsdp2'\], got 'fsdp'"):
        OptimConfig(strategy="fsdp").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fsdp_offload=true keeps FSDP2 shards in CPU memory: it needs strategy=fsdp2"):
        OptimConfig(fsdp_offload=True).validate()


def test_optimizer_impl_picks_torchs_fused_adamw_and_refuses_another(model_config):
    """The fused AdamW trains like the default within 1e-6 (at 2 ranks under fsdp2: the first test's "kept")."""
    assert PolicyWorker(model_config, replace(OPTIM, optimizer_impl="fused")).optimizer.defaults["fused"] is True
    assert not PolicyWorker(model_config, OPTIM).optimizer.defaults["fused"]
    with pytest.raises(ValueError, match=r"^optimizer_impl must be 'foreach' or 'fused', got 'adam'$"):
        OptimConfig(optimizer_impl="adam").validate()  # type: ignore[arg-type]


def test_fsdp2_on_a_model_without_decoder_layers_says_to_use_ddp(model_config):
    from asyncrl.roles.modeling.parallel import DataParallel
    from asyncrl.roles.modeling.device import resolve_placement
    from asyncrl.roles.modeling.strategy import TrainStrategy

    placement = resolve_placement(model_config, 0, trained=True, who="test")
    with pytest.raises(ValueError, match=r"PolicyWorker: strategy=fsdp2 shards a model per decoder layer, but Linear "
                                         r"declares none .*; set strategy=ddp"):
        TrainStrategy(torch.nn.Linear(2, 2), placement, DataParallel(0, 1), "fsdp2", who="PolicyWorker")


def test_the_layers_fsdp2_shards_are_read_from_a_model_directory(model_config, tmp_path):
    from asyncrl.roles import load_model, save_model_dir
    from asyncrl.roles.modeling.strategy import layer_classes

    model, tok = load_model(model_config)
    save_model_dir(model, tok, str(tmp_path))
    assert layer_classes(str(tmp_path)) == ("Qwen2ForCausalLM", ["Qwen2DecoderLayer"])
