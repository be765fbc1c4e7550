"""SGLang's own reading of the format corpus, written as JSON: the differential test's oracle.

Runs inside a scratch venv holding sglang==0.5.23 (built by `sglang_oracle_venv.sh`; SGLang's
pins conflict with the project's, so it never goes into the project's venv). SGLang's readings
import nothing of the engine; then, for names the engine reads only through SGLang, the
engine's own bridge is run here too (the one place both are importable) and its reading kept.
Usage: python sglang_oracle.py OUT.json
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from formats_corpus import BRIDGED, TOOLS, cases  # noqa: E402


def main(out_path: str) -> int:
    """Parse every case with SGLang's detector of its parser name; write {id: reading}."""
    logging.disable(logging.CRITICAL)  # the detectors log every malformed case
    started = time.perf_counter()
    import sglang
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    tools = [Tool.model_validate(t) for t in TOOLS]
    readings = {}
    for case in cases():
        parser = FunctionCallParser(tools, case["parser"])  # one per text: detectors keep state
        try:
            found = parser.has_tool_call(case["text"])
            normal, calls = parser.parse_non_stream(case["text"])
            readings[case["id"]] = {"has_tool_call": found, "normal_text": normal,
                                    "calls": [{"name": c.name, "parameters": c.parameters} for c in calls]}
        except Exception as exc:  # the oracle records a detector that raises; the test reports it
            readings[case["id"]] = {"raised": f"{type(exc).__name__}: {exc}"}
    bridged = {}
    # the checkout itself: the project venv's editable install is a .pth this venv does not process
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        from engine.profiles.parsers import get_tool_parser

        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for name, text in BRIDGED.items():
            read = get_tool_parser(name).parse(text, schemas)
            bridged[name] = {"parser": type(get_tool_parser(name)).__name__, "content": read.content,
                             "calls": [[c.name, c.arguments, c.error] for c in read.calls]}
    except Exception as exc:  # the test reports it
        bridged = {"raised": f"{type(exc).__name__}: {exc}"}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"sglang": sglang.__version__, "readings": readings, "bridged": bridged}, f, ensure_ascii=False, indent=1)
    print(f"sglang {sglang.__version__}: {len(readings)} turns read in {time.perf_counter() - started:.1f} s -> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
