"""`python -m engine run | agent | serve | diagram | trace | flow | bench | soak | settings | attacks`.

Each command's work lives in its own module, imported only when the command runs, so
`python -m engine diagram` does not load torch. A bad argument is one line on stderr
naming it and what is allowed, exit status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from engine.arguments import names, number, whole
from engine.settings.core import BUDGETS, SERVER, TOOLS, flagged_settings, load_plugins
from engine.settings.declare import Setting, SettingsError, read_key

DISTRIBUTION = "fsm-rollout-engine"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage is one `--help` away), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, unless the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


# -- the parser ---------------------------------------------------------------------------------


def version() -> str:
    """The installed version of the project ("unknown" when run from a bare checkout)."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def program_name(argv0: str | None = None) -> str:
    """How the user called us: `python -m engine` or the console script's own name."""
    argv0 = argv0 if argv0 is not None else (sys.argv[0] if sys.argv else "")
    base = os.path.basename(argv0)
    if not base or base in ("__main__.py", "-c") or base.startswith("python"):
        return "python -m engine"
    return base


def _lazy(target: str) -> Callable[[argparse.Namespace], int]:
    """The function `module:name`, imported only when its command runs."""
    module, name = target.split(":")

    def run(ns: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), name)(ns) or 0)

    return run


def _verbose_parent() -> argparse.ArgumentParser:
    """`-v` accepted after the subcommand too; SUPPRESS keeps one given before it."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO")
    return parent


def flag_type(row: Setting) -> Callable[[str], Any]:
    """argparse type of a setting's flag: its row converts and checks (a capped value is lowered later, with its warning)."""

    def parse(text: str) -> Any:
        try:
            value = row.convert(text)
        except SettingsError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(row.key + " ")) from None
        # An empty list is a value of its own where the default is None: `--tools ""` offers no tool.
        if value is None or (value == () and row.default is not None) or not row.fits(value):
            raise argparse.ArgumentTypeError(f"must be {row.allowed()}, got {text!r}")
        return value

    parse.__name__ = row.allowed()
    return parse


def flag_help(row: Setting) -> str:
    """A setting flag's help: its words, the key it sets [in brackets], and `run`'s default."""
    assert row.flag is not None
    words = row.flag.help or row.help
    again = "; repeatable" if row.flag.repeatable else ""
    return f"{words}{again} [{row.key}] (default: {row.default_text(for_run=True)})"


def add_setting_flag(group: Any, row: Setting) -> None:
    """One flag of `run`, made from its setting's row. It defaults to None: a `--config` file fills
    it, a flag wins over the file, and the help names `run`'s default."""
    flag = row.flag
    assert flag is not None
    options: dict[str, Any] = {"dest": flag.destination, "help": flag_help(row)}
    if row.kind is bool:
        options.update(action="store_true", default=None)
    elif flag.repeatable:
        options.update(action="append", metavar=flag.metavar)
    elif row.choices:
        options.update(choices=list(row.choices))
    else:
        options.update(metavar=flag.metavar, type=flag_type(row))
    group.add_argument(flag.name, **options)


def add_run_arguments(run: argparse.ArgumentParser, demos: bool = False) -> None:
    """The `run` options: its own (input, output, the YAML, the replay, with `demos` the shipped demo to
    run), then one per setting declared with a flag (the engine's, and those of the plugins imported by
    now: see `load_run_plugins`), in its group."""
    io = run.add_argument_group("input and output")
    if demos:
        from engine.local.demos import DEMOS

        io.add_argument("--demo", choices=sorted(DEMOS), help="the shipped demo whose prompts, replay and settings "
                        "to run: tools (math with a code interpreter), long (a 100-turn rollout under a 4k context, "
                        "compacted); an --input, --replay or flag given replaces the demo's (default: tools)")
    io.add_argument("--input", metavar="FILE", help="JSONL of prompts, one {\"prompt\": ..., \"label\": ...} per line "
                    "(default: the shipped demo set)")
    io.add_argument("--output", metavar="FILE", default="samples.jsonl", help="where the samples go (JSONL, in input order)")
    io.add_argument("--limit", metavar="N", type=whole(1), help="only the first N prompts of the input (default: all)")
    io.add_argument("--no-progress", action="store_true", help="no progress bar")

    groups = {SERVER: run.add_argument_group(SERVER), TOOLS: run.add_argument_group(TOOLS),
              BUDGETS: run.add_argument_group(BUDGETS)}
    groups[SERVER].add_argument("--config", metavar="YAML", help="the YAML slime's --custom-config-path reads (engine_* "
                                "keys and slime args, see docs/settings.md); flags given here win over it")
    groups[SERVER].add_argument("--replay", metavar="FILE", help="replay script for the embedded server "
                                "(default: the demo's, in the chosen profile's format)")
    for row in flagged_settings():
        assert row.flag is not None
        group = row.flag.group or BUDGETS
        if group not in groups:  # a group no flag used before (a plugin's)
            groups[group] = run.add_argument_group(group)
        add_setting_flag(groups[group], row)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line, every subcommand with its options."""
    prog = prog or program_name()
    parser = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parent = _verbose_parent()

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[parent], formatter_class=DefaultsFormatter)
        p.set_defaults(func=fn)
        return p

    run = command("run", _lazy("engine.run:main_run"), "roll out a JSONL of prompts against a server (default: the embedded demo)")
    run.epilog = ("A name in [brackets] is the key of slime's args (and of the --custom-config-path YAML) that the "
                  "option sets. Exit status: 0 done, 1 every sample or every tool call failed (or a tool cannot "
                  "work), 2 a bad argument, 130 interrupted (what finished is kept).")
    add_run_arguments(run, demos=True)

    agent = command("agent", _lazy("engine.run:main_agent"), "run an agent per prompt against a server "
                    "(default: the demo's agent and the embedded server) and write its samples: `agent [options] -- CMD ...`")
    agent.epilog = ("CMD is the harness's command line; it gets OPENAI_BASE_URL, ANTHROPIC_BASE_URL and their keys set to "
                    "its session, the prompt in ENGINE_AGENT_PROMPT (and in place of {prompt} in CMD). The options "
                    "are run's. Exit status as run's.")
    add_run_arguments(agent)
    agent.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the harness's command line")

    serve = command("serve", _lazy("engine.local.server:main_serve"), "serve SGLang's /generate API from a small CPU model")
    from engine.local.server import add_serve_arguments

    add_serve_arguments(serve)

    diagram = command("diagram", _lazy("engine.trace.diagrams:main_diagram"), "draw the machine from its definition into diagrams/")
    diagram.add_argument("--out", metavar="DIR", default="diagrams", help="output directory")
    diagram.add_argument("--check", action="store_true", help="fail if the files there are not current")
    diagram.add_argument("--tool-module", metavar="MODULE", action="append", dest="tool_modules",
                         help="also draw the tools this module registers; repeatable (default: built-in tools only)")

    trace = command("trace", _lazy("engine.trace.diagrams:main_trace"), "print the path one sample took, its turns and tool calls")
    trace.add_argument("file", help="rollout JSONL (from `run`), or slime's --save-debug-rollout-data dump")
    pick = trace.add_mutually_exclusive_group()
    pick.add_argument("--sample", metavar="INDEX", type=int, help="the sample whose `index` field is INDEX "
                      "(default: the first sample of the file)")
    pick.add_argument("--position", metavar="N", type=int, help="the sample at position N of the file (0 first, -1 last)")
    trace.add_argument("--text", action="store_true", help="also print each turn's text and each tool call with its output")
    trace.add_argument("--tokenizer", metavar="DIR", help="tokenizer for --text (default: the shipped Qwen3 one)")
    trace.add_argument("--out", metavar="PATH", help="write the highlighted diagram here (.mmd or .svg) "
                       "(default: print the Mermaid)")

    flow = command("flow", _lazy("engine.trace.diagrams:main_flow"), "draw where a batch of samples went: edge and terminal counts")
    flow.add_argument("file", help="rollout JSONL (from `run`), or slime's --save-debug-rollout-data dump")
    flow.add_argument("--out", metavar="PATH", help="write the counted diagram here (.mmd or .svg) (default: print the Mermaid)")

    bench = command("bench", _lazy("engine.local.bench:main_bench"), "measure engine overhead against its floors")
    bench.add_argument("--small", action="store_true", help="a quick smoke-size run (CI)")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.add_argument("--samples", metavar="N", type=whole(1), help="rollout samples (default: 512; --small 64)")
    bench.add_argument("--turns", metavar="N", type=whole(1), help="turns per sample (default: 8)")
    bench.add_argument("--repeats", metavar="N", type=whole(1), help="repeats per figure; medians are reported (default: 3)")

    soak = command("soak", _lazy("engine.local.soak:main_soak"), "many samples through a faulty server with real sandbox calls")
    soak.add_argument("--samples", metavar="N", type=whole(1), default=2000, help="samples to roll out")
    soak.add_argument("--concurrency", metavar="N", type=whole(1), default=256, help="samples in flight")
    soak.add_argument("--faults", metavar="SPEC", default="default", help="fault spec (see `serve --faults`)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the fault sequence")
    soak.add_argument("--json", action="store_true", help="machine-readable output")

    settings = command("settings", _lazy("engine.settings.page:main_settings"), "print every setting as the table of docs/settings.md")
    settings.add_argument("--out", metavar="PATH", help="write the whole page here (default: print the tables)")
    settings.add_argument("--check", action="store_true", help="fail if the page at --out is not current")
    settings.add_argument("--tool-module", metavar="MODULE", action="append", dest="tool_modules",
                          help="also the settings this module's plugins declare; repeatable (default: the shipped ones)")

    attacks = command("attacks", _lazy("engine.sandbox.attacks.suite:main_attacks"), "run the sandbox attack suite and print what was contained")
    attacks.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def configure_logging(ns: argparse.Namespace) -> None:
    """WARNING by default, INFO with -v; `serve` always says where it listens."""
    logging.basicConfig(level=logging.INFO if getattr(ns, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if ns.command == "serve":
        logging.getLogger("engine.local.server").setLevel(logging.INFO)


def load_run_plugins(argv: Sequence[str]) -> str | None:
    """Before `run`'s options are parsed, import the modules it names (`--tool-module`, and the YAML's
    `engine_tool_modules`), so the flags their plugins declare are options too. Returns the error line
    for a module that cannot be imported (a YAML that cannot be read is left for `run` to report)."""
    words = [w for w in argv if not w.startswith("-")]
    if not words or words[0] != "run":
        return None
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--tool-module", action="append", default=[], dest="tool_modules")
    early.add_argument("--config")
    known, _ = early.parse_known_args(argv)
    try:
        load_plugins(known.tool_modules)
    except SettingsError as exc:
        return str(exc).replace("engine_tool_modules", "--tool-module", 1)
    if known.config:  # the YAML's: one that cannot be read or imported is `run`'s to report, naming the file
        from engine.settings.sources import load_yaml_settings

        with contextlib.suppress(SettingsError):
            load_plugins(read_key("engine_tool_modules", load_yaml_settings(known.config).get("engine_tool_modules")))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m engine` and the `fsm-rollout` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    problem = load_run_plugins(argv)
    if problem:
        return fail(problem)
    ns = build_parser().parse_args(argv)
    configure_logging(ns)
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def fail(message: str, status: int = 2) -> int:
    """Print one `error:` line on stderr and return the exit status (2: a user error)."""
    print(f"error: {message}", file=sys.stderr)
    return status


__all__: list[Any] = ["build_parser", "fail", "main", "names", "number", "program_name", "version", "whole"]
