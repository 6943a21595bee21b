"""Device selection, precision and GPU-memory checks of the roles (asyncrl.roles.modeling.device).

This machine has no GPU, so "no GPU" is real here: a role asked for ``cuda`` fails at
construction. What the CPU cannot show (a GPU index past the visible ones, a CPU or GPU
without bf16, a GPU with too little free memory) is tested on the pure functions that
decide it, with the hardware facts passed in explicitly. The tests marked ``cuda`` run
only where torch sees a GPU (benchmarks/gpu_check.sh runs them there).
"""

from __future__ import annotations

import pytest
import torch

import asyncrl
from asyncrl.roles import (
    CriticWorker,
    DeviceError,
    ModelConfig,
    OptimConfig,
    PolicyWorker,
    ReferenceWorker,
    RewardConfig,
    RewardWorker,
    RolloutConfig,
    RolloutWorker,
)
from asyncrl.roles.modeling.device import (
    check_gpu_memory,
    cpu_supports_bf16,
    estimate_model_bytes,
    resolve_device,
    resolve_precision,
)
from asyncrl.roles.functional import grpo_advantages
from asyncrl.roles.modeling.models import state_dict_checksums

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh)")
needs_cpu_bf16 = pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")


# ---------------------------------------------------------------- device selection


def test_auto_is_the_cpu_when_the_bundle_has_no_gpu():
    assert resolve_device("auto", bundle_gpus=0.0) == CPU
    assert resolve_device("cpu", bundle_gpus=1.0, cuda_count=1) == CPU  # explicit cpu wins over a GPU bundle
    assert resolve_device("auto", bundle_gpus=0.5, cuda_count=1) == GPU  # fractional GPU: the one Ray exposes
    assert resolve_device("cuda:1", bundle_gpus=2, cuda_count=2) == torch.device("cuda", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_names_the_problem_and_the_fix():
    with pytest.raises(DeviceError, match=r"device='cuda' but torch sees no GPU.*gpus_per_bundle=1.*device='cpu'"):
        resolve_device("cuda", bundle_gpus=0.0)
    # a bundle that reserves a GPU torch cannot see is a setup mistake too (CPU wheel on a GPU node)
    with pytest.raises(DeviceError, match=r"bundle reserves 0.5 GPU, but torch sees no GPU"):
        resolve_device("auto", bundle_gpus=0.5)


def test_bad_device_spellings_and_indices_are_errors():
    with pytest.raises(DeviceError, match=r"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        resolve_device("gpu", bundle_gpus=0)
    with pytest.raises(DeviceError, match=r"got 'cuda:x'"):
        resolve_device("cuda:x", bundle_gpus=1, cuda_count=1)
    with pytest.raises(DeviceError, match=r"sees 2 GPU\(s\).*cuda:0..cuda:1"):
        resolve_device("cuda:2", bundle_gpus=1, cuda_count=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("build", [
    lambda m: PolicyWorker(m), lambda m: ReferenceWorker(m), lambda m: CriticWorker(m), lambda m: RolloutWorker(m),
    lambda m: RewardWorker(RewardConfig(model=m)),
], ids=["policy", "reference", "critic", "rollout", "reward_model"])
def test_every_role_refuses_cuda_without_a_gpu_at_construction(build):
    with pytest.raises(DeviceError, match="device='cuda' but torch sees no GPU"):
        build(ModelConfig(device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
async def test_cuda_role_in_a_ray_group_fails_setup_with_the_device_error(ray_cluster):
    group = asyncrl.RayWorkerGroup(PolicyWorker, world_size=1, name="cuda-policy",
                                   kwargs={"model": ModelConfig(device="cuda")})
    with pytest.raises(asyncrl.RemoteError) as info:
        await group.setup()
    assert isinstance(info.value.cause, DeviceError)
    assert "PolicyWorker: device='cuda' but torch sees no GPU" in str(info.value.cause)
    await group.close()


# ---------------------------------------------------------------- precision


@pytest.mark.parametrize("device,dtype,autocast,trained,bf16,expected", [
    (CPU, "auto", "auto", True, True, (F32, None)),        # CPU: fp32 everywhere
    (CPU, "auto", "auto", False, True, (F32, None)),
    (GPU, "auto", "auto", True, True, (F32, BF16)),        # GPU, trained: fp32 master weights + bf16 autocast
    (GPU, "auto", "auto", False, True, (BF16, None)),      # GPU, frozen (rollout/reference): bf16 weights
    (GPU, "auto", "auto", True, False, (F32, None)),       # GPU without bf16 (pre-Ampere): fp32
    (GPU, "float32", "auto", True, True, (F32, None)),     # explicit fp32 means fp32
    (GPU, "float32", "bfloat16", True, True, (F32, BF16)),
    (CPU, "bfloat16", "auto", True, True, (BF16, None)),   # explicit bf16 on a CPU that has it
    (CPU, "float32", "bfloat16", True, True, (F32, BF16)),
    (GPU, "bfloat16", "bfloat16", True, True, (BF16, None)),  # autocast to the weights' own dtype is a no-op
    (GPU, "float16", "off", False, True, (F16, None)),
])
def test_precision_table(device, dtype, autocast, trained, bf16, expected):
    assert resolve_precision(dtype, autocast, device, trained=trained, bf16_supported=bf16) == expected


def test_bf16_without_hardware_support_is_a_setup_error():
    with pytest.raises(DeviceError, match=r"bf16 requested.*this CPU has no native bf16.*dtype='float32'"):
        resolve_precision("bfloat16", "auto", CPU, trained=True, bf16_supported=False)
    with pytest.raises(DeviceError, match=r"this CPU has no native bf16"):
        resolve_precision("float32", "bfloat16", CPU, trained=True, bf16_supported=False)
    with pytest.raises(DeviceError, match=r"this GPU has no native bf16 \(compute capability < 8.0\)"):
        resolve_precision("bfloat16", "off", GPU, trained=False, bf16_supported=False)
    with pytest.raises(DeviceError, match=r"dtype must be 'auto' or one of"):
        resolve_precision("fp8", "auto", CPU, trained=True, bf16_supported=True)
    with pytest.raises(DeviceError, match=r"autocast must be"):
        resolve_precision("auto", "yes", CPU, trained=True, bf16_supported=True)


@needs_cpu_bf16
async def test_bf16_weights_and_bf16_autocast_on_cpu_compute_in_float32(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=5))
    batch = await rollout.generate(prompt_batch(n=4, repeat=2))
    fp32 = PolicyWorker(model_config)
    lp32 = fp32.compute_log_prob(batch)["old_log_probs"]
    for cfg, params in ((ModelConfig(seed=0, dtype="bfloat16"), BF16), (ModelConfig(seed=0, autocast="bfloat16"), F32)):
        policy = PolicyWorker(cfg, OptimConfig(micro_batch_size=4, lr=1e-2))
        assert {p.dtype for p in policy.model.parameters()} == {params}
        lp = policy.compute_log_prob(batch)
        assert lp["old_log_probs"].dtype == F32 and lp["entropy"].dtype == F32  # log-softmax upcast to fp32
        mask = batch["response_mask"].bool()
        diff = (lp["old_log_probs"] - lp32)[mask].abs().max().item()
        assert 0 < diff < 0.1  # bf16 compute: close to fp32, not equal
        b = batch.clone(False)
        b.update(lp)
        b["scores"] = (b["response_ids"][:, 0] % 2).float()
        b["advantages"] = grpo_advantages(b["scores"], b["uid"], b["response_mask"])
        metrics = policy.update(b)
        assert metrics["version"] == 1.0 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert {p.dtype for p in policy.model.parameters()} == {params}  # autocast never casts the weights


@needs_cpu_bf16
async def test_bf16_rollout_takes_fp32_policy_weights_cast_on_the_way(model_config, prompt_batch):
    policy = PolicyWorker(model_config)
    rollout = RolloutWorker(ModelConfig(seed=0, dtype="bfloat16"), RolloutConfig(max_new_tokens=4,
                                                                                 verify_checksums=True))
    assert {t.dtype for t in rollout.model.state_dict().values()} == {BF16}
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01)
    policy._version = 1
    # object store path: export in the rollout's dtype (half the bytes), verified against the cast checksums
    v, sd = policy.export_weights(dtype="bfloat16")
    assert {t.dtype for t in sd.values()} == {BF16}
    receipt = await rollout.update_weights((v, sd), expected_checksums=policy.weights_checksum(dtype="bfloat16"))
    assert receipt["checksums_verified"] and rollout.version == 1
    # fp32 tensors into the bf16 rollout are cast there (same bits as casting on the policy)
    policy._version = 2
    await rollout.update_weights(policy.export_weights())
    assert rollout.engine.weights_checksum() == policy.weights_checksum(dtype="bfloat16")


# ---------------------------------------------------------------- GPU memory


def test_model_state_estimate_and_the_memory_error():
    assert estimate_model_bytes(1000, F32, trained=True) == 16_000  # weights + grads + two AdamW moments
    assert estimate_model_bytes(1000, BF16, trained=False) == 2_000
    check_gpu_memory(2_000, 2_000, 10_000, who="RolloutWorker", device="cuda:0")  # exactly fits
    gib = 1024 ** 3
    with pytest.raises(DeviceError, match=r"PolicyWorker: needs about 3.00 GiB.*only 1.00 of 80.00 GiB are free.*"
                                          r"colocate fewer roles.*sleep_level"):
        check_gpu_memory(3 * gib, 1 * gib, 80 * gib, who="PolicyWorker", device="cuda:0")


# ---------------------------------------------------------------- sleep / wake


async def test_rollout_sleep_level_2_discards_weights_and_a_resync_restores_them(model_config, prompt_batch):
    policy = PolicyWorker(model_config)
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6, sleep_level=2))
    batch = prompt_batch("mixed", n=4, repeat=2)
    before = await rollout.generate(batch, seed=3)
    sums = rollout.engine.weights_checksum()
    assert await rollout.sleep() == {"asleep": True, "level": 2}
    assert all(p.numel() == 0 for p in rollout.model.parameters())  # the memory is gone
    with pytest.raises(RuntimeError, match="asleep \\(level 2\\); call wake_up\\(\\)"):
        await rollout.generate(batch)
    with pytest.raises(RuntimeError, match="asleep at level 2"):
        await rollout.update_weights(policy.export_weights())
    assert await rollout.wake_up() == {"needs_weights": True, "version": 0}
    with pytest.raises(RuntimeError, match="discarded its weights in sleep\\(level=2\\)"):
        await rollout.generate(batch)
    receipt = await rollout.update_weights(policy.export_weights())  # the same version 0 is accepted once
    assert receipt["version"] == 0 and rollout.engine.weights_checksum() == sums
    again = await rollout.generate(batch, seed=3)
    assert torch.equal(again["response_ids"], before["response_ids"])
    assert torch.equal(again["rollout_log_probs"], before["rollout_log_probs"])
    from asyncrl.roles import StaleWeightsError

    with pytest.raises(StaleWeightsError):  # ... and only while the weights are missing
        await rollout.update_weights(policy.export_weights())


async def test_rollout_sleep_level_1_keeps_the_weights_and_is_off_by_default(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=4, sleep_level=1))
    sums = rollout.engine.weights_checksum()
    assert await rollout.sleep() == {"asleep": True, "level": 1}
    with pytest.raises(RuntimeError, match="asleep \\(level 1\\)"):
        await rollout.generate(prompt_batch(n=2))
    assert await rollout.wake_up() == {"needs_weights": False, "version": 0}
    assert rollout.engine.weights_checksum() == sums
    off = RolloutWorker(model_config, RolloutConfig(max_new_tokens=4))
    assert await off.sleep() == {"asleep": False, "level": 0}  # sleep_level=0: nothing released
    with pytest.raises(ValueError, match="sleep_level must be 0, 1 or 2"):
        RolloutWorker(model_config, RolloutConfig(sleep_level=3))


# ---------------------------------------------------------------- on a GPU (benchmarks/gpu_check.sh)


@needs_cuda
async def test_roles_on_cuda_compute_on_the_gpu_and_return_cpu_tensors(prompt_batch):
    cfg = ModelConfig(seed=0, device="cuda")
    rollout = RolloutWorker(cfg, RolloutConfig(max_new_tokens=8))
    policy = PolicyWorker(cfg, OptimConfig(micro_batch_size=4))
    assert policy.placement_info()["device"] == "cuda:0" and rollout.placement.is_cuda
    expect_amp = "bfloat16" if torch.cuda.is_bf16_supported() else "off"
    assert policy.placement_info()["autocast"] == expect_amp
    batch = await rollout.generate(prompt_batch("mixed", n=8, repeat=2))
    assert batch["response_ids"].device.type == "cpu"
    lp = policy.compute_log_prob(batch)
    assert lp["old_log_probs"].device.type == "cpu" and lp["old_log_probs"].dtype == F32
    mask = batch["response_mask"].bool()
    diff = (lp["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 0.1  # bf16 rollout vs fp32+bf16-autocast policy
    b = batch.clone(False)
    b.update(lp)
    b["scores"] = (b["response_ids"][:, 0] % 2).float()
    b["advantages"] = grpo_advantages(b["scores"], b["uid"], b["response_mask"])
    assert policy.update(b)["version"] == 1.0
    handle = policy.stage_weights("local", dtype="bfloat16")
    await rollout.update_weights(handle)
    assert rollout.engine.weights_checksum() == policy.weights_checksum(dtype="bfloat16")


@needs_cuda
async def test_sleep_releases_gpu_memory_and_wake_restores_it(prompt_batch):
    rollout = RolloutWorker(ModelConfig(seed=0, device="cuda", hidden_size=256, intermediate_size=512),
                            RolloutConfig(max_new_tokens=4, sleep_level=1))
    sums = rollout.engine.weights_checksum()
    awake = torch.cuda.memory_allocated()
    await rollout.sleep()
    assert torch.cuda.memory_allocated() < awake
    await rollout.wake_up()
    assert rollout.engine.weights_checksum() == sums
    out = await rollout.generate(prompt_batch(n=2))
    assert out["response_ids"].shape == (2, 4)


@needs_cuda
def test_a_gpu_with_too_little_free_memory_fails_at_construction():
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(int(free - (64 << 20)), dtype=torch.uint8, device="cuda")  # leave 64 MiB
    try:
        with pytest.raises(DeviceError, match="needs about .* GiB of GPU memory"):
            PolicyWorker(ModelConfig(device="cuda", hidden_size=1024, num_layers=8, intermediate_size=4096))
    finally:
        del hog
        torch.cuda.empty_cache()


def test_checksums_of_cast_weights_match_between_policy_and_rollout_dtypes(model_config):
    policy = PolicyWorker(model_config)
    sd = {k: v.to(BF16) for k, v in policy.model.state_dict().items()}
    assert policy.weights_checksum(dtype="bfloat16") == state_dict_checksums(sd.items())
    assert policy.weights_checksum() != policy.weights_checksum(dtype="bfloat16")
