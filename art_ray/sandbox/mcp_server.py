"""The sandbox's tools over MCP, for agents (and frameworks) that take their tools from an MCP server: the
same `bash`, `python` and `str_replace_editor` as art_ray/sandbox/tools.py, on one leased box.

    server = sandbox_mcp_server(SandboxTools(box))
    async with mcp.Client(server) as client:            # in-process; or serve it over stdio / HTTP
        result = await client.call_tool("bash", {"command": "ls"})

The model's mistakes are tool results with `is_error` (MCP: the model should see them and correct
itself); a failure of the sandbox is an MCP error response, as the protocol asks for conditions that are
not the tool's answer, so the rollout is dropped rather than scored.
"""

from __future__ import annotations

from typing import Any

from art_ray.errors import SandboxError
from art_ray.sandbox.tools import SandboxTools

# JSON-RPC's "internal error": the server (here: the sandbox) failed, not the request
INTERNAL_ERROR = -32603


def sandbox_mcp_server(tools: SandboxTools, name: str = "art-ray-sandbox") -> Any:
    """An MCP `Server` (mcp 2.x, low level) listing and calling `tools`."""
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError

    listed = [
        types.Tool(
            name=schema["function"]["name"],
            description=schema["function"]["description"],
            input_schema=schema["function"]["parameters"],
        )
        for schema in tools.schemas
    ]

    async def list_tools(_context: Any, _params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(_context: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            answer = await tools.answer(params.name, params.arguments or {})
        except SandboxError as error:
            raise MCPError(INTERNAL_ERROR, f"the sandbox failed: {error}") from error
        return types.CallToolResult(
            content=[types.TextContent(text=answer.content)], is_error=answer.is_error
        )

    return Server(name, on_list_tools=list_tools, on_call_tool=call_tool)
