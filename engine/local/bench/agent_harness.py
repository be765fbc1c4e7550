"""The benchmark's agent harness, a subprocess: sessions that call the front door in lockstep rounds.

Why a subprocess: what a harness spends building and sending its history is not the engine's
cost, and on 2 cores it would be counted as the engine's if it ran in the engine's process.
It reads one JSON line on stdin (`{"urls": [session base URL, ...], "turns": T, "tools": [...]}`),
then for round 1..T makes every session's next Chat Completions call at once, answers each
call of the replies with a result, and prints `ROUND k` when the round is over (the engine's
process reads its own CPU time at each line). A refusal or an error is printed and ends it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

SYSTEM = "You add numbers with the add tool, one call at a time."
TASK = "Keep adding: 1+2, then the result plus 2, and so on."


async def _run(spec: dict[str, Any]) -> None:
    import httpx

    urls: list[str] = spec["urls"]
    histories: list[list[dict[str, Any]]] = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
                                             for _ in urls]
    limits = httpx.Limits(max_connections=len(urls))
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:

        async def call(url: str, history: list[dict[str, Any]]) -> None:
            reply = await client.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer bench"},
                                      json={"model": "policy", "messages": history, "tools": spec["tools"]})
            if reply.status_code != 200:
                raise RuntimeError(f"{reply.status_code}: {reply.text[:200]}")
            message = reply.json()["choices"][0]["message"]
            history.append({k: v for k, v in message.items() if v is not None})
            for made in message.get("tool_calls") or ():
                history.append({"role": "tool", "tool_call_id": made["id"], "content": "3"})

        for k in range(1, int(spec["turns"]) + 1):
            await asyncio.gather(*(call(url, history) for url, history in zip(urls, histories)))
            print(f"ROUND {k}", flush=True)


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    try:
        asyncio.run(_run(spec))
    except Exception as exc:  # the parent reads the line and reports it
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        return 1
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
