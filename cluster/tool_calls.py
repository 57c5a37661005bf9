"""Tool calls: a chat's ``tools`` with ``tool_choice`` ``"required"`` or a named function,
answered as OpenAI's ``tool_calls`` whose arguments follow the function's JSON schema.

The answer is decoded under a structure (``cluster.structured``): for one function (named,
or the only one of a ``"required"`` choice) the arguments object itself, which streams as
the arguments' deltas; for several, ``{"name": ..., "arguments": ...}`` with the name one
of theirs, which is read once the answer is whole.

``"auto"`` (OpenAI's default where tools are given) is refused: the model would have to
choose between text and a call before its first block, and a diffusion model decodes a
block's positions in any order, so the choice is not the first token it commits; a client
that wants either asks for ``"required"`` or for text.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from typing import Any

from cluster.structured import StructureError

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolChoice:
    """The functions an answer may call and the JSON schema its text follows."""

    names: tuple[str, ...]
    schema: dict

    @property
    def wrapped(self) -> bool:
        """The answer names its function (several to choose from)."""
        return len(self.names) > 1

    def call(self, text: str) -> tuple[str, str]:
        """The function an answer calls and its arguments' JSON text."""
        if not self.wrapped:
            return self.names[0], text
        called = json.loads(text)
        return called["name"], json.dumps(called["arguments"], ensure_ascii=False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def whole_call(tools: ToolChoice | None, text: str) -> dict | None:
    """A whole answer's tool call; None: no tools asked, or an answer cut short (a stop
    string, its deadline) that names no function, which stays text."""
    if tools is None:
        return None
    try:
        name, arguments = tools.call(text)
    except (ValueError, KeyError, TypeError):
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class StreamedCall:
    """One choice's tool call as its stream's events carry it: one function's arguments as
    they commit (the first event names the call), or, where the answer names its function,
    the whole call once the answer is whole."""

    def __init__(self, tools: ToolChoice):
        self.tools = tools
        self.id = new_call_id()
        self.started = False
        self.text = ""

    def event(self, choice: Any, finished: bool) -> Any | None:
        """``choice`` (a stream event's ``protocol.Choice``) as a tool call's; None: nothing to send yet."""
        if self.tools.wrapped:
            self.text += choice.text
            if not finished:
                return None
            return dataclasses.replace(choice, first=True, tool_call=whole_call(self.tools, self.text))
        call: dict = {"function": {"arguments": choice.text}}
        if not self.started:
            call = {"id": self.id, "type": "function", "function": {"name": self.tools.names[0],
                                                                   "arguments": choice.text}}
            self.started = True
        return dataclasses.replace(choice, tool_call=call)


def _functions(tools: Any) -> dict[str, dict]:
    """Each function's name and its parameters' schema; raises StructureError."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise StructureError(f"must be a list of at most {MAX_TOOLS} tools", "tools")
    functions = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise StructureError("each tool must be {'type': 'function', 'function': {'name': ..., "
                                 "'parameters': {...}}}", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise StructureError(f"the parameters of {function['name']!r} must be a JSON schema object", "tools")
        functions[function["name"]] = parameters
    return functions


def tool_choice(tools: Any, choice: Any) -> ToolChoice | None:
    """What a chat's ``tools`` and ``tool_choice`` ask; None: a text answer. Raises
    StructureError naming the field."""
    if choice == "none" or (not tools and choice is None):
        return None
    if not tools:
        raise StructureError("a tool choice needs tools", "tool_choice")
    functions = _functions(tools)
    if choice is None or choice == "auto":
        raise StructureError("'auto' is not supported: a diffusion model does not decide between text and a "
                             "call before it decodes; ask for 'required' or a named function", "tool_choice")
    if choice == "required":
        names = tuple(functions)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise StructureError(f"names the function {name!r}, which is not one of the tools", "tool_choice")
        names = (name,)
    else:
        raise StructureError("must be 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
                             "tool_choice")
    if len(names) == 1:
        return ToolChoice(names, functions[names[0]])
    return ToolChoice(names, {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, "arguments": functions[name]},
         "required": ["name", "arguments"]} for name in names]})
