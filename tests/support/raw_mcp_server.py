"""An MCP server over stdio written by hand (JSON-RPC lines), for what the SDK's own server refuses
to send: it lists `ok_echo` (a valid tool) beside `bad_properties` and `bad_type`, whose input
schemas are not JSON object schemas. With `--surrogate` its calls answer text read from bytes with
surrogateescape, which json.dumps writes as a lone surrogate ("\\udcff") the SDK cannot read; with
`--deep` their result holds a value nested 100,000 deep, past every JSON parser's stack here."""

from __future__ import annotations

import json
import sys

TOOLS = [
    {"name": "ok_echo", "description": "Echo a text.",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
    {"name": "bad_properties", "description": "Properties that are not schemas.",
     "inputSchema": {"type": "object", "properties": {"x": "string"}}},
    {"name": "bad_type", "description": "Not an object schema.", "inputSchema": {"type": "array"}},
]


def answer(request: dict) -> dict | None:
    method, params = request.get("method"), request.get("params") or {}
    if "id" not in request:
        return None  # a notification
    if method == "initialize":
        result = {"protocolVersion": params.get("protocolVersion", "2025-06-18"), "capabilities": {"tools": {}},
                  "serverInfo": {"name": "raw", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        text = "echo: " + str(params.get("arguments", {}).get("text"))
        if "--surrogate" in sys.argv:
            text = b"a file's \xff byte".decode("utf-8", "surrogateescape")
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    else:
        return {"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


for line in sys.stdin:
    if line.strip():
        reply = answer(json.loads(line))
        if reply is not None and "--deep" in sys.argv and reply.get("result", {}).get("content"):
            deep = "[" * 100_000 + "]" * 100_000  # written by hand: json.dumps cannot nest this far
            sys.stdout.write(f'{{"jsonrpc": "2.0", "id": {json.dumps(reply["id"])}, "result": '
                             f'{{"content": [], "structuredContent": {{"v": {deep}}}}}}}\n')
            sys.stdout.flush()
        elif reply is not None:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
