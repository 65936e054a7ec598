"""The agent tools on a leased sandbox (art_ray/sandbox/tools.py): the schemas OpenAI's API takes, each tool
run for real on the default backend, the model's mistakes answered as text, the sandbox's raised."""

from __future__ import annotations

import json
import os

import pytest

from art_ray.errors import SandboxError
from art_ray.sandbox import SANDBOX_TOOLS, SandboxLimits, SandboxPool, SandboxTools, run_tests
from art_ray.sandbox.namespaces import NamespaceBackend

FIRST_UID = 172000  # apart from the other sandbox tests'
LIMITS = SandboxLimits(wall_s=3, memory_mb=256, processes=16, output_bytes=4096, workspace_mb=16)


def test_each_schema_is_an_openai_function_tool_from_its_model() -> None:
    import openai.types.chat as chat
    import pydantic

    tools = pydantic.TypeAdapter(list[chat.ChatCompletionFunctionToolParam]).validate_python(SANDBOX_TOOLS)
    assert [tool["function"]["name"] for tool in tools] == ["bash", "python", "str_replace_editor"]
    editor = SANDBOX_TOOLS[2]["function"]
    assert editor["parameters"]["required"] == ["command", "path"]
    assert editor["parameters"]["properties"]["command"]["enum"] == [
        "view",
        "create",
        "str_replace",
        "insert",
    ]
    assert "exactly once" in editor["description"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the per-slot uids need root")
async def test_an_agent_fixes_a_file_with_the_tools_and_the_hidden_tests_pass() -> None:
    async with SandboxPool(1, LIMITS, NamespaceBackend(FIRST_UID)) as pool, pool.lease(ttl_s=60) as box:
        tools = SandboxTools(box)
        source = "def add(a, b):\n    return a - b\n"
        created = await tools.call(
            "str_replace_editor", {"command": "create", "path": "calc.py", "file_text": source}
        )
        assert created == f"created calc.py ({len(source)} characters)"
        view = await tools.call("str_replace_editor", json.dumps({"command": "view", "path": "calc.py"}))
        assert view == "     1\tdef add(a, b):\n     2\t    return a - b"
        assert "calc.py" in await tools.call("str_replace_editor", {"command": "view", "path": "."})
        hidden = {"test_calc.py": "from calc import add\n\nassert add(2, 3) == 5\n"}
        outcome = await run_tests(box, hidden, "python test_calc.py", timeout_s=30)
        assert (outcome.status, outcome.result.exit_code) == ("failed", 1), outcome

        # the model's mistakes come back as text it can read
        twice = {"command": "str_replace", "path": "calc.py", "old_str": "a", "new_str": "x"}
        assert "found 3 times" in await tools.call("str_replace_editor", twice)
        assert "not found" in await tools.call(
            "str_replace_editor", {"command": "str_replace", "path": "calc.py", "old_str": "zzz"}
        )
        assert (await tools.call("bash", "{not json")).startswith("error: bad arguments for bash")
        assert "command: Field required" in await tools.call("bash", {})
        assert "no tool named 'rm'" in await tools.call("rm", {})
        assert (await tools.call("str_replace_editor", {"command": "view", "path": "nope.py"})).startswith(
            "error:"
        )

        fixed = {"command": "str_replace", "path": "calc.py", "old_str": "a - b", "new_str": "a + b"}
        assert await tools.call("str_replace_editor", fixed) == "edited calc.py"
        top = {"command": "insert", "path": "calc.py", "insert_line": 0, "new_str": '"""Sums."""'}
        assert "after line 0" in await tools.call("str_replace_editor", top)
        assert (
            await tools.call("bash", {"command": "head -1 calc.py; exit 3"})
            == 'exit code 3\nstdout:\n"""Sums."""\n'
        )
        assert (
            await tools.call("python", {"code": "from calc import add; print(add(2, 3))"})
            == "exit code 0\nstdout:\n5\n"
        )
        assert (await tools.call("bash", {"command": "sleep 5", "timeout_s": 0.5})).startswith("timed out")
        outcome = await run_tests(box, hidden, "python test_calc.py", timeout_s=30)
        assert outcome.status == "passed", outcome


@pytest.mark.skipif(os.geteuid() != 0, reason="the per-slot uids need root")
async def test_a_dead_slot_raises_instead_of_answering() -> None:
    async with SandboxPool(1, LIMITS, NamespaceBackend(FIRST_UID)) as pool, pool.lease(ttl_s=60) as box:
        box.slot.kill()
        with pytest.raises(SandboxError):
            await SandboxTools(box).call("bash", {"command": "echo hi"})


@pytest.mark.skipif(os.geteuid() != 0, reason="the per-slot uids need root")
async def test_the_mcp_server_lists_and_calls_the_same_tools() -> None:
    from mcp import Client
    from mcp.shared.exceptions import MCPError

    from art_ray.sandbox.mcp_server import sandbox_mcp_server

    async with (
        SandboxPool(1, LIMITS, NamespaceBackend(FIRST_UID)) as pool,
        pool.lease(ttl_s=60) as box,
        Client(sandbox_mcp_server(SandboxTools(box))) as client,
    ):
        listed = (await client.list_tools()).tools
        assert [tool.name for tool in listed] == ["bash", "python", "str_replace_editor"]
        assert listed[0].input_schema == SANDBOX_TOOLS[0]["function"]["parameters"]
        result = await client.call_tool("bash", {"command": "echo hi > f.txt; cat f.txt"})
        assert (result.is_error, result.content[0].text) == (False, "exit code 0\nstdout:\nhi\n")
        assert await box.read_file("f.txt") == b"hi\n"
        wrong = await client.call_tool("str_replace_editor", {"command": "view", "path": "missing.txt"})
        assert wrong.is_error and wrong.content[0].text.startswith("error:")
        box.slot.kill()  # the sandbox fails: an MCP error, not a tool answer
        with pytest.raises(MCPError, match="the sandbox failed"):
            await client.call_tool("bash", {"command": "echo hi"})
