"""A command-line harness: the add task over the OpenAI SDK, configured by the environment alone
(OPENAI_BASE_URL, OPENAI_API_KEY, ENGINE_AGENT_PROMPT), as a CLI harness is. Exits 3 on a refusal."""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from types import SimpleNamespace  # noqa: E402

import openai  # noqa: E402

from tests.support.agent_harnesses import add_task  # noqa: E402


def main() -> int:
    base = os.environ["OPENAI_BASE_URL"].removesuffix("/v1")
    print("harness starts:", os.environ["ENGINE_AGENT_PROMPT"], *sys.argv[1:], flush=True)
    try:
        asyncio.run(add_task(base, os.environ["OPENAI_API_KEY"], SimpleNamespace(prompt=os.environ["ENGINE_AGENT_PROMPT"])))
    except openai.APIStatusError as exc:
        print("refused:", exc.status_code, flush=True)
        return 3
    print("harness done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
