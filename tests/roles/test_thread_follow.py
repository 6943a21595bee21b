"""``ModelConfig.num_threads="follow"``: the opted-in workers on one machine split its cores among those
busy now (``cores // busy`` each, at least 1), the count changes inside a pass at the next decoder layer
(forward and backward, on the computing thread), a dead worker's mark is released by the kernel, the
roles mark themselves busy exactly while they compute, and bad values are refused before workers start.

The marks are driven directly (no timing): each test names the cores it shares so the expected counts do
not depend on the machine, except where a role takes the machine's own (``available_cores()``)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.roles import ModelConfig, OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker
from asyncrl.roles.modeling.models import build_model, set_torch_threads, tiny_tokenizer
from asyncrl.roles.modeling.threads import CoreShare, available_cores, core_share_for, marks_dir


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_lone_busy_worker_takes_every_core_and_busy_workers_split_them(tmp_path, restore_threads):
    a, b, c = (CoreShare(tmp_path, cores=4, name=n) for n in ("a", "b", "c"))
    with a.busy() as n:
        assert (n, torch.get_num_threads(), a.others_busy()) == (4, 4, 0)
        with b.busy() as m:
            assert (m, a.threads(), b.threads(), a.sync(), torch.get_num_threads()) == (2, 2, 2, 2, 2)
            with c.busy():
                assert (a.threads(), c.threads()) == (1, 1)  # 4 // 3, never 0
            assert a.threads() == 2
        assert (a.sync(), torch.get_num_threads()) == (4, 4)
        with a.busy():  # re-entrant: the inner exit keeps the mark
            pass
        assert (b.others_busy(), a.is_busy) == (1, True)
    assert (b.others_busy(), a.is_busy) == (0, False)
    a.close()
    assert sorted(os.listdir(tmp_path)) == ["b", "c"]
    with pytest.raises(RuntimeError, match=r"CoreShare.busy after close\(\)"), a.busy():
        pass


def test_a_worker_that_dies_busy_releases_its_share(tmp_path, restore_threads):
    a = CoreShare(tmp_path, cores=2, name="a")
    r, w = os.pipe()  # child -> parent: "marked busy"
    r2, w2 = os.pipe()  # parent -> child: closed when the child may die
    pid = os.fork()
    if pid == 0:  # the child: mark busy, say so, wait, die without any clean-up
        try:
            os.close(r)
            os.close(w2)
            share = CoreShare(tmp_path, cores=2, name=f"{os.getpid()}-child")
            mark = share.busy()
            mark.__enter__()
            os.write(w, b"x")
            os.read(r2, 1)
        finally:
            os._exit(0)
    os.close(w)
    os.close(r2)
    assert os.read(r, 1) == b"x"
    os.close(r)
    assert a.threads() == 1  # the child holds its mark
    os.close(w2)
    os.waitpid(pid, 0)
    assert a.threads() == 2  # the kernel dropped the lock with the process
    assert f"{pid}-child" in os.listdir(tmp_path)
    CoreShare(tmp_path, cores=2, name="later")  # a later worker sweeps the dead worker's file
    assert sorted(os.listdir(tmp_path)) == ["a", "later"]


def test_a_new_run_removes_the_marks_of_earlier_runs_whose_workers_are_all_gone(tmp_path, restore_threads):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a process id that no longer exists
    runs = {"asyncrl-cores-ended": [f"{pid}-a", f"{pid}-b"], "asyncrl-cores-empty": [],
            "asyncrl-cores-live": [f"{pid}-a", f"{os.getpid()}-c"], "unrelated": [f"{pid}-a"]}
    for d, files in runs.items():
        (tmp_path / d).mkdir()
        for f in files:
            (tmp_path / d / f).touch()
    share = CoreShare(tmp_path / "asyncrl-cores-new", cores=2, name="n")
    assert sorted(os.listdir(tmp_path)) == ["asyncrl-cores-live", "asyncrl-cores-new", "unrelated"]
    assert sorted(os.listdir(tmp_path / "asyncrl-cores-live")) == sorted(runs["asyncrl-cores-live"])  # one live
    assert os.listdir(tmp_path / "unrelated") == [f"{pid}-a"]
    share.close()
    assert sorted(os.listdir(tmp_path)) == ["asyncrl-cores-live", "unrelated"]  # its own, emptied, removed


def test_the_thread_count_changes_between_layers_in_forward_and_backward(tmp_path, restore_threads):
    """Another worker's mark set or cleared between two decoder layers changes the count the next layer
    runs with, seen inside the layer on the computing thread (backward included)."""
    model = build_model(ModelConfig(seed=0, num_layers=3), tiny_tokenizer())
    a, b = CoreShare(tmp_path, cores=4, name="a"), CoreShare(tmp_path, cores=4, name="b")
    assert a.attach(model) == 3
    layers = model.model.layers
    seen: list[tuple[str, int, bool]] = []
    main = threading.get_ident()
    other = b.busy()

    def record(tag: str):
        def grad_hook(g: torch.Tensor) -> None:
            seen.append((f"backward-in{tag}", torch.get_num_threads(), threading.get_ident() == main))
            if tag == "2":
                other.__exit__(None, None, None)  # b goes idle after layer 2's backward

        def pre(module, args, kwargs):
            seen.append((f"forward{tag}", torch.get_num_threads(), threading.get_ident() == main))
            x = args[0] if args else kwargs["hidden_states"]
            if x.requires_grad:
                x.register_hook(grad_hook)  # after the share's hook on the same tensor
        return pre

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(record(str(i)), with_kwargs=True)

    def b_busy(*_: object) -> None:
        other.__enter__()

    layers[0].register_forward_hook(b_busy)  # b busy from layer 1 on
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.set_num_threads(1)
    with a.busy():
        logits = model(input_ids=ids, inputs_embeds=None).logits
        assert [s[:2] for s in seen] == [("forward0", 4), ("forward1", 2), ("forward2", 2)]
        seen.clear()
        logits.sum().backward()
    # b is busy when backward starts, idle after layer 2's: layers 1 and 0 take every core again
    assert seen == [("backward-in2", 2, True), ("backward-in1", 4, True), ("backward-in0", 4, True)]


def test_follow_is_a_no_op_on_a_gpu_and_for_other_settings(restore_threads):
    assert core_share_for("follow", "cuda:0") is None
    assert core_share_for(0, "cpu") is None and core_share_for(None, "cpu") is None
    share = core_share_for("follow", "cpu", cores=3)
    try:
        assert share is not None and share.cores == 3 and share.directory == marks_dir()
    finally:
        share.close()
    assert set_torch_threads(1.0, "follow") == 1  # until a compute call sets it: the worker's CPU share


@pytest.mark.parametrize("bad", [-1, "folow", 1.5, True])
def test_bad_thread_settings_are_refused_with_the_choices(bad, restore_threads):
    cfg = tiny_test()
    cfg.model.num_threads = bad
    wrong_type = isinstance(bad, (bool, float))  # caught by the type check of every key, before the choices
    with pytest.raises(ConfigError, match=(r"model\.num_threads must be an integer, a string or null, got " if wrong_type
                                           else r"model\.num_threads must be null \(the worker's CPU share\), 0 \(every "
                                           r"core of the machine\), 'follow' \(the machine's cores split among the workers "
                                           r"busy now\) or a positive integer, got ") + repr(bad).replace(".", r"\.")):
        cfg.validate()
    if not isinstance(bad, bool):
        with pytest.raises(ValueError, match=r"num_threads must be None .*'follow' .* got " + repr(bad).replace(".", r"\.")):
            set_torch_threads(1.0, bad)
    cfg.model.num_threads = "follow"
    cfg.validate()


async def test_rollout_and_policy_are_busy_exactly_while_they_compute(prompt_batch, restore_threads):
    """A third share on the same machine sees the rollout busy while it decodes and the policy while it
    updates; each computes on every core alone and on half when the third is busy."""
    from asyncrl.roles.functional import grpo_advantages

    mc = ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads="follow")
    rollout = RolloutWorker(mc, RolloutConfig(max_new_tokens=4))
    policy = PolicyWorker(mc, OptimConfig(micro_batch_size=8))
    cores = available_cores()
    observer = CoreShare(marks_dir(), cores=cores, name=f"{os.getpid()}-observer")
    seen: list[tuple[str, int, int]] = []
    for tag, w in (("rollout", rollout), ("policy", policy)):
        w.model.register_forward_pre_hook(lambda m, a, tag=tag: seen.append((tag, observer.others_busy(),
                                                                               torch.get_num_threads())))
    try:
        assert observer.others_busy() == 0
        out = await rollout.generate(prompt_batch("char_class", n=2, repeat=2))
        assert set(seen) == {("rollout", 1, cores)}
        seen.clear()
        out["advantages"] = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), out["uid"], out["response_mask"])
        out.update(policy.compute_log_prob(out))
        assert seen == [("policy", 1, cores)]
        seen.clear()
        with observer.busy():
            policy.update(out)
        assert seen == [("policy", 1, max(1, cores // 2))]  # the policy busy beside the observer: half each
        assert observer.others_busy() == 0
    finally:
        observer.close()
        rollout.on_close()
        policy.on_close()


@pytest.mark.slow  # an actor start imports torch: ~4 s on a quiet 2-core machine
def test_two_ray_worker_processes_on_one_machine_split_the_cores(ray_cluster, restore_threads):
    """The driver and a Ray actor (two processes of one run on one machine) find one marks directory and
    split the cores; killing the actor gives its share back."""
    import ray

    @ray.remote(num_cpus=0)
    class Marker:
        def __init__(self) -> None:
            self.share = core_share_for("follow", "cpu", cores=4)
            self.hold = self.share.busy()

        def busy(self) -> tuple[str, int]:
            return str(self.share.directory), self.hold.__enter__()

        def threads(self) -> int:
            return self.share.threads()

    a = core_share_for("follow", "cpu", cores=4)
    b = Marker.remote()
    try:
        with a.busy() as alone:
            assert alone == 4  # alone: every core
            assert ray.get(b.busy.remote()) == (str(a.directory), 2)  # same directory; two busy: half each
            assert (a.threads(), ray.get(b.threads.remote())) == (2, 2)
            ray.kill(b)
            deadline = time.monotonic() + 60  # the process exits after the kill returns: poll, bounded
            while a.threads() != 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert a.threads() == 4  # the dead worker's share came back
    finally:
        a.close()
        ray.kill(b)
