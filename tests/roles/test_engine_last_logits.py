"""The HF engine computes the LM head on the last position only (as ``generate`` does): every
forward of a sampling loop returns one position of logits, the prompt's included."""

from __future__ import annotations

from asyncrl.roles import SamplingParams, load_model, make_engine


async def test_every_forward_of_the_sampling_loop_returns_the_last_positions_logits_only(model_config):
    model, tok = load_model(model_config)
    eng = make_engine("hf", model=model, tokenizer=tok, model_dir=None)
    shapes = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        shapes.append((tuple(kwargs["input_ids"].shape), tuple(out.logits.shape[:2])))
        return out

    model.forward = recording
    prompts = [tok("say cat.")["input_ids"], tok("echo dog sun")["input_ids"]]
    done = await eng.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0, seed=1))
    P = max(map(len, prompts))
    steps = max(len(c.response_ids) for c in done)
    assert shapes[0] == ((2, P), (2, 1))  # the prompt's forward: one position of logits, not P
    assert shapes[1:] == [((2, 1), (2, 1))] * (steps - 1)


def test_response_log_probs_runs_the_lm_head_on_the_response_positions_only_with_the_same_values(model_config):
    """Training's and old_log_prob's forward (``response_log_probs``) pass ``logits_to_keep=R+1``: the
    LM head sees R+1 positions, not the prompt's too, and the log-probs and entropies equal those of
    the full-sequence logits. A model whose forward takes no such argument gets the full forward."""
    import torch

    from asyncrl.roles._util import response_log_probs
    from asyncrl.roles.functional import entropy_from_logits
    from asyncrl.roles.modeling.models import position_ids_from_mask

    model, tok = load_model(model_config)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    R = 5
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[1]))
    lp, ent = response_log_probs(model, ids, mask, ids[:, -R:], temperature=0.7)
    hook.remove()
    assert rows == [R + 1]
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                     use_cache=False).logits[:, -R - 1:-1].float() / 0.7
    want = torch.log_softmax(full, -1).gather(-1, ids[:, -R:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp.detach(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.detach(), entropy_from_logits(full), rtol=0, atol=1e-5)

    class Plain(torch.nn.Module):  # forward(**kwargs): no logits_to_keep in its signature
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, **kwargs):  # noqa: ANN003, ANN202
            assert "logits_to_keep" not in kwargs
            return self.inner(**kwargs)

    lp_plain, _ = response_log_probs(Plain(), ids, mask, ids[:, -R:], temperature=0.7, with_entropy=False)
    torch.testing.assert_close(lp_plain.detach(), want, rtol=0, atol=1e-5)
