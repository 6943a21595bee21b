"""``OptimConfig.max_grad_norm`` (README "Training"): the policy reports the total gradient norm before
clipping (verl's ``grad_norm``), clips the gradient to ``max_grad_norm`` (torch's ``clip_grad_norm_``), and
the optimizer step is AdamW's on the clipped gradient. Pinned on the tiny model against an unclipped twin
built from the same seed; the relations are exact (floating point tolerance only), the norm's value itself
depends on torch's kernels and is not pinned."""

from __future__ import annotations

import torch
from asyncrl.roles import OptimConfig, PolicyWorker

LR, EPS = 1e-2, 1e-3


def _grads(policy: PolicyWorker) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def _weights(policy: PolicyWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))


def test_max_grad_norm_reports_the_norm_before_clipping_and_steps_on_the_clipped_gradient(
        model_config, prompt_batch):
    def policy(max_grad_norm: float | None) -> PolicyWorker:
        return PolicyWorker(model_config, OptimConfig(lr=LR, eps=EPS, max_grad_norm=max_grad_norm,
                                                      micro_batch_size=8, kl_coef=0.0, entropy_coef=0.0))

    batch = prompt_batch(n=4, repeat=2)  # responses written by hand: no rollout engine needed
    gen = torch.Generator().manual_seed(0)
    batch["response_ids"] = torch.randint(3, 40, (8, 6), generator=gen)
    batch["response_mask"] = (torch.arange(6)[None, :] < torch.tensor([6, 5, 4, 6, 3, 6, 2, 6])[:, None]).long()
    batch["input_ids"] = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    batch["attention_mask"] = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    free = policy(None)
    batch.update(free.compute_log_prob(batch))
    signs = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25])  # advantages of both signs: a gradient
    batch["advantages"] = signs[:, None] * batch["response_mask"].float()
    w0 = _weights(free)

    g_norm = free.update(batch)["grad_norm"]
    g = _grads(free)
    assert g_norm > 0 and abs(g_norm - _norm(g)) <= 1e-6 * g_norm  # unclipped: the norm of the gradient stepped on

    limit = g_norm / 4
    clipped = policy(limit)
    assert _weights(clipped).keys() == w0.keys() and all(torch.equal(_weights(clipped)[n], w0[n]) for n in w0)
    m = clipped.update(batch)
    assert abs(m["grad_norm"] - g_norm) <= 1e-6 * g_norm  # reported before clipping
    gc = _grads(clipped)
    assert abs(_norm(gc) - limit) <= 1e-5 * limit  # clipped to max_grad_norm
    scale = limit / (g_norm + 1e-6)  # torch's clip coefficient
    for n in g:
        torch.testing.assert_close(gc[n], g[n] * scale, rtol=1e-5, atol=1e-9)
    # AdamW's first step (no weight decay): w -= lr * grad / (|grad| + eps), elementwise, on the clipped gradient
    w_clip, w_free = _weights(clipped), _weights(free)
    for n in g:
        torch.testing.assert_close(w_clip[n], w0[n] - LR * gc[n] / (gc[n].abs() + EPS), rtol=0, atol=1e-6)
        torch.testing.assert_close(w_free[n], w0[n] - LR * g[n] / (g[n].abs() + EPS), rtol=0, atol=1e-6)
    assert max(float((w_clip[n] - w_free[n]).abs().max()) for n in g) > 1e-4  # the clip changed the step

    none_clipped = policy(10 * g_norm)  # a limit above the norm leaves the gradient as it is
    none_clipped.update(batch)
    for n in g:
        torch.testing.assert_close(_grads(none_clipped)[n], g[n], rtol=1e-6, atol=0)
