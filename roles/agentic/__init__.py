"""Multi-turn episodes, environments, tools, and the OpenAI-compatible gateway for agents."""
