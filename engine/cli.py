"""`python -m engine run | serve | diagram | trace | flow | bench | soak | attacks`.

Each command's work lives in its own module, imported only when the command runs, so
`python -m engine diagram` does not load torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence


def _lazy(target: str) -> Callable[[argparse.Namespace], int]:
    """The function `module:name`, imported only when its command runs."""
    module, name = target.split(":")

    def run(ns: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), name)(ns) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    """The command line, every subcommand with its options."""
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=fn)
        return p

    run = command("run", _lazy("engine.local.run:main_run"), "roll out a JSONL of prompts against a server (default: the embedded demo)")
    run.add_argument("--input", help="JSONL of prompts (default: the shipped demo set)")
    run.add_argument("--output", default="samples.jsonl", help="where the samples go (JSONL)")
    run.add_argument("--server", help="SGLang server or router URL (default: start the embedded server)")
    run.add_argument("--tokenizer", help="local tokenizer directory (default: the shipped Qwen3 one)")
    run.add_argument("--profile", choices=["retool", "chat"], default="retool")
    run.add_argument("--concurrency", type=int, default=64, help="samples in flight")
    run.add_argument("--max-context", type=int, help="prompt + response budget (default: the server's context)")
    run.add_argument("--max-new-tokens", type=int, default=512, help="per-turn cap")
    run.add_argument("--max-turns", type=int, default=16)
    run.add_argument("--max-tool-calls", type=int, default=16)
    run.add_argument("--tool-timeout", type=float, default=120.0)
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--replay", help="replay script for the embedded server (default: the demo's)")
    run.add_argument("--limit", type=int, help="only the first N prompts")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    serve = command("serve", _lazy("engine.local.server:main_serve"), "serve SGLang's /generate API from a small CPU model")
    from engine.local.server import add_serve_arguments

    add_serve_arguments(serve)

    diagram = command("diagram", _lazy("engine.trace.diagrams:main_diagram"), "draw the machine from its definition into diagrams/")
    diagram.add_argument("--out", default="diagrams", help="output directory")
    diagram.add_argument("--check", action="store_true", help="fail if the files there are not current")

    trace = command("trace", _lazy("engine.trace.diagrams:main_trace"), "draw the path one sample took")
    trace.add_argument("file", help="rollout JSONL, or slime's --save-debug-rollout-data dump")
    trace.add_argument("--sample", default="0", help="sample index (or its 'index' field)")
    trace.add_argument("--out", help="write the highlighted diagram here (.mmd or .svg)")

    flow = command("flow", _lazy("engine.trace.diagrams:main_flow"), "draw where a batch of samples went: edge and terminal counts")
    flow.add_argument("file", help="rollout JSONL, or slime's --save-debug-rollout-data dump")
    flow.add_argument("--out", help="write the counted diagram here (.mmd or .svg)")

    bench = command("bench", _lazy("engine.local.bench:main_bench"), "measure engine overhead against its floors")
    bench.add_argument("--small", action="store_true", help="a quick smoke-size run (CI)")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.add_argument("--samples", type=int, help="rollout samples (default 512; --small 64)")
    bench.add_argument("--turns", type=int, help="turns per sample (default 8)")
    bench.add_argument("--repeats", type=int, help="repeats per figure (medians are reported)")

    soak = command("soak", _lazy("engine.local.soak:main_soak"), "many samples through a faulty server with real sandbox calls")
    soak.add_argument("--samples", type=int, default=2000)
    soak.add_argument("--concurrency", type=int, default=256)
    soak.add_argument("--faults", default="default", help="fault spec (see `serve --faults`)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", action="store_true")

    attacks = command("attacks", _lazy("tools.sandbox.attacks.suite:main_attacks"), "run the sandbox attack suite and print what was contained")
    attacks.add_argument("--json", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m engine` and the `fsm-rollout` script."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
