"""Tools an agent calls on its leased sandbox: OpenAI function schemas for `bash`, `python` and a file
editor (`str_replace_editor`: view, create, str_replace, insert, as SWE-agent's and Anthropic's text editor),
and the dispatcher that runs a call and answers the tool message's content.

    tools = SandboxTools(box)                        # a box from pool.lease(), local or on Ray
    completion = await client.chat.completions.create(..., tools=tools.schemas)
    for call in completion.choices[0].message.tool_calls or []:
        content = await tools.call(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": content})

What the model did wrong (arguments that are not JSON or miss a field, a file that does not exist, an
`old_str` found twice, a command that fails) comes back as the tool's answer for it to read; what the
sandbox did wrong (a dead slot, an expired lease) raises SandboxError, so the rollout is dropped, not
scored. Each schema is generated from the pydantic model that validates its arguments.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic

from art_ray.errors import SandboxFileError
from art_ray.sandbox.types import ExecResult, LeasedSandbox

# what a tool answers is cut to this many characters (head and tail kept): a model's context is small
MAX_ANSWER_CHARS = 8000


class BashCall(pydantic.BaseModel):
    """Run a bash command in the sandbox's working directory (/workspace); answers its exit code and
    output."""

    model_config = pydantic.ConfigDict(extra="forbid")

    command: str = pydantic.Field(description="the command line, run with `bash -c`")
    timeout_s: float | None = pydantic.Field(None, gt=0, le=600, description="seconds before it is killed")


class PythonCall(pydantic.BaseModel):
    """Run a Python program in the sandbox (/workspace); answers its exit code and output."""

    model_config = pydantic.ConfigDict(extra="forbid")

    code: str = pydantic.Field(description="the program's source")
    timeout_s: float | None = pydantic.Field(None, gt=0, le=600, description="seconds before it is killed")


class EditorCall(pydantic.BaseModel):
    """View, create and edit files in the sandbox. `view`: a file with line numbers, or a directory's
    entries; `create`: write `file_text` to `path`; `str_replace`: replace `old_str`, which must occur
    exactly once, with `new_str`; `insert`: insert `new_str` after line `insert_line` (0: at the top)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    command: Literal["view", "create", "str_replace", "insert"]
    path: str = pydantic.Field(description="relative to /workspace, or absolute")
    file_text: str | None = pydantic.Field(None, description="create: the file's content")
    old_str: str | None = pydantic.Field(None, description="str_replace: the text to replace")
    new_str: str | None = pydantic.Field(None, description="str_replace and insert: the new text")
    insert_line: int | None = pydantic.Field(None, ge=0, description="insert: after this line")
    view_range: tuple[int, int] | None = pydantic.Field(
        None, description="view: first and last line (1-based; -1 for the end)"
    )


TOOL_CALLS: dict[str, type[pydantic.BaseModel]] = {
    "bash": BashCall,
    "python": PythonCall,
    "str_replace_editor": EditorCall,
}


def tool_schema(name: str, call: type[pydantic.BaseModel]) -> dict[str, Any]:
    """The OpenAI function tool for `call`: its docstring the description, its JSON schema the
    parameters."""
    parameters = call.model_json_schema()
    parameters.pop("title", None)
    description = " ".join((call.__doc__ or "").split())
    parameters.pop("description", None)
    for field in parameters.get("properties", {}).values():
        field.pop("title", None)
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


SANDBOX_TOOLS: list[dict[str, Any]] = [tool_schema(name, call) for name, call in TOOL_CALLS.items()]


def shortened(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def describe(result: ExecResult) -> str:
    """A command's outcome as the model reads it."""
    if result.timed_out:
        status = "timed out"
    elif result.exit_code is not None and result.exit_code < 0:
        status = f"killed by signal {-result.exit_code}"
    else:
        status = f"exit code {result.exit_code}"
    parts = [status]
    if result.stdout:
        parts.append(f"stdout:\n{result.stdout}")
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    if result.truncated:
        parts.append("(output truncated)")
    return shortened("\n".join(parts))


class ToolAnswer(pydantic.BaseModel):
    """What a tool call answers: the tool message's content, and whether it reports the model's mistake
    (MCP's `is_error`: the call was wrong, the sandbox is fine)."""

    content: str
    is_error: bool = False


def mistake(message: str) -> ToolAnswer:
    return ToolAnswer(content=f"error: {message}", is_error=True)


class SandboxTools:
    """The tools on one leased box; `schemas` go in the request's `tools`, `call` answers a tool call."""

    schemas = SANDBOX_TOOLS

    def __init__(self, box: LeasedSandbox) -> None:
        self.box = box

    async def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        """The tool message's content for a call of `name` with `arguments` (the call's JSON string)."""
        return (await self.answer(name, arguments)).content

    async def answer(self, name: str, arguments: str | dict[str, Any]) -> ToolAnswer:
        """`call`'s answer, with whether it is the model's mistake; raises SandboxError when the sandbox
        failed."""
        kind = TOOL_CALLS.get(name)
        if kind is None:
            return mistake(f"no tool named {name!r}; the tools are {', '.join(TOOL_CALLS)}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            call = kind.model_validate(parsed)
        except ValueError as error:  # not JSON, or pydantic's ValidationError
            return mistake(f"bad arguments for {name}: {_first_line(error)}")
        try:
            if isinstance(call, BashCall):
                return ToolAnswer(content=describe(await self.box.run(call.command, call.timeout_s)))
            if isinstance(call, PythonCall):
                return ToolAnswer(content=describe(await self.box.python(call.code, call.timeout_s)))
            assert isinstance(call, EditorCall)
            return await self._edit(call)
        except SandboxFileError as error:
            return mistake(str(error))

    async def _edit(self, call: EditorCall) -> ToolAnswer:
        if call.command == "create":
            if call.file_text is None:
                return mistake("create needs file_text")
            await self.box.write_file(call.path, call.file_text)
            return ToolAnswer(content=f"created {call.path} ({len(call.file_text)} characters)")
        if call.command == "view":
            return await self._view(call)
        text = (await self.box.read_file(call.path)).decode("utf-8", "replace")
        if call.command == "str_replace":
            if call.old_str is None:
                return mistake("str_replace needs old_str")
            count = text.count(call.old_str)
            if count != 1:
                where = "not found" if count == 0 else f"found {count} times; add context to make it unique"
                return mistake(f"old_str {where} in {call.path}")
            await self.box.write_file(call.path, text.replace(call.old_str, call.new_str or "", 1))
            return ToolAnswer(content=f"edited {call.path}")
        lines = text.splitlines(keepends=True)
        if call.insert_line is None or call.new_str is None:
            return mistake("insert needs insert_line and new_str")
        if call.insert_line > len(lines):
            return mistake(f"insert_line {call.insert_line} is past the end ({len(lines)} lines)")
        new = call.new_str if call.new_str.endswith("\n") else call.new_str + "\n"
        lines.insert(call.insert_line, new)
        await self.box.write_file(call.path, "".join(lines))
        return ToolAnswer(
            content=f"inserted {new.count(chr(10))} line(s) after line {call.insert_line} of {call.path}"
        )

    async def _view(self, call: EditorCall) -> ToolAnswer:
        try:
            data = await self.box.read_file(call.path)
        except SandboxFileError:
            entries = await self.box.list_dir(call.path)  # a directory, or the caller's error again
            return ToolAnswer(content=shortened("\n".join(sorted(entries)) or "(empty directory)"))
        lines = data.decode("utf-8", "replace").splitlines()
        first, last = call.view_range or (1, -1)
        last = len(lines) if last == -1 else min(last, len(lines))
        if first < 1 or first > max(1, last):
            return mistake(f"view_range {call.view_range} is outside the file's {len(lines)} lines")
        numbered = (f"{number:6}\t{line}" for number, line in enumerate(lines[first - 1 : last], first))
        return ToolAnswer(content=shortened("\n".join(numbered)))


def _first_line(error: Exception) -> str:
    if isinstance(error, pydantic.ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in error.errors())
    return str(error).splitlines()[0] if str(error) else type(error).__name__
