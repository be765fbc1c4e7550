"""The MCP SDK through its public face only, per supported version range.

The engine's MCP client (engine/tools/mcp_*.py) names nothing private of the SDK (nor of anyio
or httpx2, which it reaches through the SDK): no `_module`, no `_name`, no attribute fetched by a
string starting with `_`. What it does use is pinned here, name by name, for the range the
pyproject allows; `tools/mcp_versions.sh` runs the MCP tests against each minor release.
"""

from __future__ import annotations

import ast
import inspect
import re
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MCP_MODULES = sorted((ROOT / "engine" / "tools").glob("mcp_*.py"))
THIRD_PARTY = ("mcp", "mcp_types", "anyio", "httpx2")
OWN_PRIVATE = {"_fn"}  # engine.tools' own: the function a @tool wraps (mcp_servers names where a clash is defined)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def private_uses(source: str, where: str) -> list[str]:
    """Every private name of another library that `source` imports, reads, or fetches by string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            found += [f"{where}: {node.module}.{a.name}" for a in node.names
                      if any(p.startswith("_") for p in [*node.module.split("."), a.name])]
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in THIRD_PARTY and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{where}:{node.lineno}: .{node.attr} of something not its own")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and node.args[1].value.startswith("_") and node.args[1].value not in OWN_PRIVATE):
            found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_client_modules_name_nothing_private_of_the_sdk() -> None:
    assert {p.name for p in MCP_MODULES} >= {"mcp_servers.py", "mcp_connection.py", "mcp_stdio.py", "mcp_spec.py"}
    assert [hit for path in MCP_MODULES for hit in private_uses(path.read_text(encoding="utf-8"), path.name)] == []


def test_the_scan_finds_each_form_of_a_private_name() -> None:
    planted = ("from mcp.shared._httpx_utils import create_mcp_http_client\n"
               "import mcp.shared._stream_protocols\n"
               "x = session._dispatcher.send_raw_request\n"
               "y = getattr(session, '_tool_output_schemas', None)\n"
               "z = self._own + getattr(tool, '_fn', None)\n")
    assert sorted(private_uses(planted, "planted")) == [
        "planted: import mcp.shared._stream_protocols",
        "planted: mcp.shared._httpx_utils.create_mcp_http_client",
        "planted:3: ._dispatcher of something not its own",
        "planted:4: getattr(..., '_tool_output_schemas')",
    ]


# The SDK's public names the engine calls, and the parameters it passes them. One range today:
# 2.0 to 2.3 share this surface (checked by running tests/tools/test_mcp_*.py on each).
RANGES = {"2.0 to before 3": ((2, 0), (3, 0))}


@pytest.mark.parametrize("span", list(RANGES))
def test_the_public_surface_the_engine_uses(span: str) -> None:
    mcp = pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'fsm-rollout-engine[mcp]')")
    low, high = RANGES[span]
    installed = _version(metadata.version("mcp"))
    if not low <= installed[:2] < high:
        pytest.skip(f"mcp {metadata.version('mcp')} is outside {span}")
    pinned = re.search(r'"mcp>=(\d+),<(\d+)"', (ROOT / "pyproject.toml").read_text()).groups()  # type: ignore[union-attr]
    assert (int(pinned[0]), 0) >= low and (int(pinned[1]), 0) <= high, "the pyproject pin left the ranges tested here"

    from mcp.client.stdio import get_default_environment
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    session = mcp.ClientSession
    assert list(inspect.signature(session).parameters)[:2] == ["read_stream", "write_stream"]
    for method, params in {"initialize": [], "list_tools": ["params"], "call_tool": ["name", "arguments"],
                           "send_request": ["request", "result_type"], "send_ping": []}.items():
        assert set(params) <= set(inspect.signature(getattr(session, method)).parameters), method
    assert {"url", "http_client"} <= set(inspect.signature(streamable_http_client).parameters)
    assert {"PATH", "HOME"} & set(get_default_environment()) or not get_default_environment()
    message = jsonrpc_message_adapter.validate_json('{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}', by_name=False)
    assert isinstance(message, mcp.types.JSONRPCRequest) and SessionMessage(message).message is message
    request = mcp.types.CallToolRequest(params=mcp.types.CallToolRequestParams(name="add", arguments={"a": 1}))
    assert request.model_dump(by_alias=True, mode="json", exclude_none=True)["method"] == "tools/call"
    assert mcp.types.PaginatedRequestParams(cursor="c").cursor == "c"
    assert mcp.MCPError(-32602, "bad").code == -32602
    assert mcp.types.CallToolResult(content=[], isError=True).is_error
    assert hasattr(mcp.types.InitializeResult.model_fields.get("server_info"), "annotation")
