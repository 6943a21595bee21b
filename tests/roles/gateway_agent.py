"""Agents for tests/roles/test_gateway.py (loaded as ``rollout.agent=<this file>:<function>``)."""

from openai import AsyncOpenAI


async def two_turns(sample, base_url):
    """Ask, then ask again on the same conversation; the reward is the number of characters answered."""
    client = AsyncOpenAI(base_url=base_url, api_key=base_url.api_key, max_retries=0)
    msgs = [{"role": "user", "content": sample.prompt}]
    r = await client.chat.completions.create(model="whatever", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    r = await client.chat.completions.create(model="whatever", messages=msgs)
    return float(len(r.choices[0].message.content) > 0)


async def no_reward(sample, base_url, api_key):
    """One request with the key as a third parameter; the reward function scores it."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": sample.prompt}])
    return None


def not_async(sample, base_url):
    return 0.0


async def two_turns_random(sample, base_url):
    """`two_turns` whose second message carries a random number: its calls are not a function of what it got."""
    import random

    client = AsyncOpenAI(base_url=base_url, api_key=base_url.api_key, max_retries=0)
    msgs = [{"role": "user", "content": sample.prompt}]
    r = await client.chat.completions.create(model="whatever", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": f"sure? {random.random():.6f}"}]
    r = await client.chat.completions.create(model="whatever", messages=msgs)
    return float(len(r.choices[0].message.content) > 0)


async def own_key(sample, base_url):
    """`two_turns` as an agent written for any local OpenAI-compatible server: it sets its own key."""
    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    msgs = [{"role": "user", "content": sample.prompt}]
    r = await client.chat.completions.create(model="whatever", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    r = await client.chat.completions.create(model="whatever", messages=msgs)
    return float(len(r.choices[0].message.content) > 0)
