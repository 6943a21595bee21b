"""Tools: async functions an episode calls between generations, each with a per-call deadline.

A tool that raises, or passes its deadline, never crashes the episode: :func:`call_tool`
returns a :class:`ToolResult` whose ``observation`` tells the model what went wrong
(``<error>...</error>``), and ``error`` is counted in the episode's metrics. Register a tool::

    @tool("calc", deadline_s=1.0)
    async def calc(expression: str) -> str:
        ...

A tool that is not an ``async def`` is refused when it is registered (and a config that names an
unknown tool is refused before any worker starts: :func:`check_tools`).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from asyncrl.roles.errors import EpisodeConfigError
from asyncrl.roles.registry import Registry

__all__ = ["Tool", "ToolResult", "tool", "register_tool", "get_tool", "tool_names", "check_tools", "call_tool",
           "calculator"]


@dataclass(frozen=True)
class Tool:
    """An async function with a name and a per-call deadline."""

    name: str
    """What episodes and configs call it."""
    fn: Callable[..., Awaitable[Any]]
    """The ``async def``; its result is turned into the observation with ``str()``."""
    deadline_s: float = 5.0
    """Seconds one call may take; past it the call is cancelled and becomes a timeout observation."""

    def __post_init__(self) -> None:
        if not inspect.iscoroutinefunction(self.fn):
            raise EpisodeConfigError(
                f"tool {self.name!r}: {getattr(self.fn, '__qualname__', self.fn)!r} is not async; tools must be "
                "`async def` (wrap blocking code with `await asyncio.to_thread(...)`)")
        if not self.deadline_s > 0:
            raise EpisodeConfigError(f"tool {self.name!r}: deadline_s must be > 0, got {self.deadline_s}")


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call."""

    observation: str
    """What the model sees: ``<result>...</result>`` or ``<error>...</error>``."""
    error: str | None = None
    """None on success, else ``"timeout"`` or the exception's type name."""


_TOOLS: Registry[Tool] = Registry("tool", error=EpisodeConfigError,
                                  how_to_register="Register one with @asyncrl.roles.tool(name)")


def register_tool(t: Tool, *, replace: bool = False) -> Tool:
    """Make `t` available by name (:func:`get_tool`)."""
    return _TOOLS.add(t.name, t, replace=replace)


def tool(name: str | None = None, *, deadline_s: float = 5.0,
         replace: bool = False) -> Callable[[Callable[..., Awaitable[Any]]], Tool]:
    """Decorator: register an ``async def`` as a :class:`Tool` (name defaults to the function's)."""

    def deco(fn: Callable[..., Awaitable[Any]]) -> Tool:
        return register_tool(Tool(name or fn.__name__, fn, deadline_s), replace=replace)

    return deco


def tool_names() -> list[str]:
    """Names of the registered tools."""
    return _TOOLS.names()


def get_tool(name: str | Tool) -> Tool:
    """The registered tool `name` (a :class:`Tool` is returned as is)."""
    if isinstance(name, Tool):
        return name
    return _TOOLS.get(name)


def check_tools(names: list[Any]) -> list[Tool]:
    """Resolve tool names (or :class:`Tool` / async functions) up front; a config error names the bad one."""
    out = []
    for n in names:
        if isinstance(n, (str, Tool)):
            out.append(get_tool(n))
        elif callable(n):
            out.append(Tool(getattr(n, "__name__", repr(n)), n))
        else:
            raise EpisodeConfigError(f"tools must be names, Tool objects or async functions, got {n!r}")
    return out


async def call_tool(t: Tool, *args: Any, **kwargs: Any) -> ToolResult:
    """Run one call within the tool's deadline; a raise or a timeout becomes an error observation."""
    try:
        async with asyncio.timeout(t.deadline_s):
            value = await t.fn(*args, **kwargs)
    except TimeoutError:
        return ToolResult(f"<error>tool {t.name} timed out after {t.deadline_s:g}s</error>", "timeout")
    except Exception as e:  # a tool's bug is the model's observation, never the run's crash
        return ToolResult(f"<error>tool {t.name} failed: {type(e).__name__}: {e}</error>", type(e).__name__)
    return ToolResult(f"<result>{value}</result>")


# ---- the built-in calculator ---------------------------------------------------------------------

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


@tool("calc", deadline_s=1.0)
async def calculator(expression: str) -> str:
    """Evaluate ``+ - * / // %`` arithmetic on numbers (no names, no calls); integers print without ``.0``."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    v = _eval(ast.parse(expression.strip(), mode="eval"))
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)
