"""Generation engines (HF in-process, vLLM) behind one interface; see :mod:`.base`."""

from asyncrl.roles.engines.base import _ENGINES, Completion, GenerationEngine, SamplingParams, engine_names, make_engine, register_engine

# The built-in engines, each imported (and so registered) on first use: the package names its modules, so
# that no engine module and the registry import each other.
for _name, _module in (("hf", "asyncrl.roles.engines.hf"), ("vllm", "asyncrl.roles.engines.vllm_engine"),
                       ("sim", "asyncrl.roles.engines.sim")):
    _ENGINES.add_lazy(_name, _module)

__all__ = ["Completion", "GenerationEngine", "SamplingParams", "engine_names", "make_engine", "register_engine"]
