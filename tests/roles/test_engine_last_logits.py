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
