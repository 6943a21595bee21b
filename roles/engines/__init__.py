"""Generation engines (HF in-process, vLLM) behind one interface; see :mod:`.base`."""

from .base import Completion, GenerationEngine, SamplingParams, engine_names, make_engine, register_engine

__all__ = ["Completion", "GenerationEngine", "SamplingParams", "engine_names", "make_engine", "register_engine"]
