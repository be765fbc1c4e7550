"""The main job: roll out a JSONL of prompts, write the samples, print a summary.

Everything the user gave is checked before anything starts (`plan_run`): the paths, the
settings (read as a slime job reads them, through their declarations in `engine.settings`, from
`--config` YAML and the flags, the flags winning; the plugins' too), the tokenizer, the tool modules, and
then whether every offered tool can work at all (`engine.loop.preflight`). A bad argument
is one `error:` line and exit status 2; a tool that cannot work stops the job with exit 1.

With no `--server`, the embedded SGLang-compatible server is started on a free loopback
port with the shipped demo replay (in the chosen profile's format), and stopped at the end.
Samples are written as they finish to `OUTPUT.partial`, then put in input order under
OUTPUT at the end, on Ctrl-C or on SIGTERM (Slurm, Kubernetes, `timeout` stop a job so), so
OUTPUT is never half-written and what finished is kept; the exit status is then 130 or 143.
Otherwise it is 1 when every sample, or every tool call, failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import httpx

from engine.logs import warn_once
from engine.settings import sources
from engine.settings.core import EngineConfig, Sampling, flagged_settings, load_plugins, run_rows
from engine.settings.declare import SettingsError, declared_keys, read_key
from engine.local.demos import DEMOS, demo_file, demo_replay
from engine.local.sample import Sample
from engine.sglang.client import request_once

log = logging.getLogger("engine.settings")
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 128 + signal.SIGTERM


# All made from the declarations (the plugins' imported by now included):


def flag_keys() -> dict[str, str]:
    """Each flag of `run` (its parsed name) and the key of slime's args (and of the YAML) it sets."""
    return {s.flag.destination: s.key for s in flagged_settings() if s.flag is not None and s.key}


def run_defaults() -> dict[str, Any]:
    """A local run's own defaults where they differ from a training job's (fewer connections and retries)."""
    return {s.key: s.run_default for s in run_rows() if s.run_default is not None}


class UsageError(Exception):
    """An argument or setting the user must change: one line, exit status 2."""


class CannotRun(Exception):
    """The job cannot work as set up (a dead tool, a server that did not start): exit status 1."""


class Terminated(Exception):
    """SIGTERM arrived: the run stops as on Ctrl-C, keeping what finished (exit status 143)."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` where the run is (outside the event loop;
    inside it, `roll_out` cancels its work first). Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


# -- reading the input ------------------------------------------------------------------------


def read_prompts(path: str) -> list[Sample]:
    """One Sample per line; a line that is not a prompt becomes a FAILED sample, not an exit."""
    samples: list[Sample] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            sample = Sample(index=len(samples), group_index=len(samples), session_id=uuid.uuid4().hex)
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "prompt" not in row:
                    raise ValueError('each line must be a JSON object with a "prompt"')
                if not isinstance(row["prompt"], (str, list)) or not row["prompt"]:
                    raise ValueError('"prompt" must be a non-empty string or a list of chat messages')
                sample.prompt, sample.label = row["prompt"], row.get("label")
                sample.metadata = dict(row.get("metadata") or {})
            except (ValueError, TypeError) as exc:
                sample.status = Sample.Status.FAILED
                sample.metadata = {"fsm": {"termination_reason": "bad_input_line", "engine_error": f"line {n + 1}: {exc}"}}
            samples.append(sample)
    return samples


def expand_groups(prompts: list[Sample], n: int) -> list[Sample]:
    """`n` samples per prompt (a GRPO group): `group_index` is the prompt's, `index` runs in input order."""
    out: list[Sample] = []
    for group, base in enumerate(prompts):
        copies = 1 if base.status is not Sample.Status.PENDING else n  # a bad line is reported once
        for k in range(copies):
            out.append(Sample(group_index=group, index=len(out), prompt=base.prompt, label=base.label,
                              status=base.status, metadata=json.loads(json.dumps(base.metadata)),
                              session_id=uuid.uuid4().hex if k else base.session_id))
    return out


# -- checking everything before starting -------------------------------------------------------


@attrs.frozen
class Plan:
    """A run whose every argument was checked: what to roll out, with which settings, where."""

    cfg: EngineConfig
    samples: list[Sample]
    params: dict[str, Any]
    output: str
    server: str | None  # None: start the embedded server
    replay: str | None
    tokenizer: Any
    progress: bool
    tools: tuple[str, ...] = ()  # the tools offered


def settings_args(ns: argparse.Namespace) -> argparse.Namespace:
    """slime's `args` as this run's settings make them: the run's defaults, the YAML, then the flags.

    The modules the YAML and the flags name are imported first (raises SettingsError for one that
    cannot be): the settings their plugins declare are known before any key of the YAML is judged.
    """
    data: dict[str, Any] = {}
    if getattr(ns, "config", None):
        try:
            data = sources.load_yaml_settings(ns.config)
        except SettingsError as exc:
            raise UsageError(f"--config: {exc}") from None
    load_plugins(read_key("engine_tool_modules", data.get("engine_tool_modules")))
    load_plugins(getattr(ns, "tool_modules", None) or ())
    args = argparse.Namespace(**run_defaults())
    unknown = sources.unknown_keys(data)  # every key of this YAML is the engine's: nothing else reads it
    for key, closest in unknown.items():
        warn_once(sources.unknown_key_message(key, closest), log)
    for key, value in data.items():  # as slime does with --custom-config-path
        if key not in unknown:
            setattr(args, key, value)
    for dest, key in flag_keys().items():
        value = getattr(ns, dest, None)
        if value is not None:
            setattr(args, key, value)
    return args


def _origin(ns: argparse.Namespace, key: str) -> str:
    """Where a setting came from, for an error message: its flag, or the YAML key."""
    for s in flagged_settings():
        if s.key == key and s.flag is not None and getattr(ns, s.flag.destination, None) is not None:
            return s.flag.name
    return f"{key} in {ns.config}" if getattr(ns, "config", None) else key


def check_output(path: str, input_path: str) -> None:
    """OUTPUT must be a file we can create, and not the input. Tried for real (root ignores modes)."""
    if os.path.isdir(path):
        raise UsageError(f"--output {path}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--output {path}: the directory {parent} does not exist")
    if os.path.exists(path) and os.path.exists(input_path) and os.path.samefile(path, input_path):
        raise UsageError(f"--output {path}: is the input file; give another name")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".fsm-rollout-write-test-"):
            pass
    except OSError as exc:
        raise UsageError(f"--output {path}: cannot write in {parent} ({exc.strerror or exc})") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"--output {path}: the file exists and is not writable")


def read_input(path: str, limit: int | None) -> list[Sample]:
    """The prompts of INPUT (the first `limit`); warns about lines that are not prompts."""
    if not os.path.exists(path):
        raise UsageError(f"--input {path}: no such input file")
    if not os.path.isfile(path):
        raise UsageError(f"--input {path}: not a file")
    try:
        prompts = read_prompts(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--input {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    prompts = prompts[:limit] if limit else prompts
    bad = [s for s in prompts if s.status is not Sample.Status.PENDING]
    if not prompts:
        raise UsageError(f"--input {path}: holds no prompts (one JSON object with a \"prompt\" per line)")
    if len(bad) == len(prompts):
        raise UsageError(f"--input {path}: no line is a prompt ({bad[0].metadata['fsm']['engine_error']})")
    if bad:
        first = bad[0].metadata["fsm"]["engine_error"]
        print(f"warning: --input {path}: {len(bad)} of {len(prompts)} lines are not prompts ({first}); "
              "each is recorded as a FAILED sample", file=sys.stderr)
    return prompts


def check_tokenizer(ns: argparse.Namespace, cfg: EngineConfig) -> Any:
    """Load the tokenizer (and the profile on it) now, so a wrong path is one clear line."""
    from engine.profiles import make_profile
    from engine.profiles.tokenizer import load_tokenizer

    path = cfg.tokenizer_path
    if path is not None and not os.path.isdir(path):
        raise UsageError(f"{_origin(ns, 'hf_checkpoint')} {path}: not a directory; give a local directory "
                         "holding tokenizer files (tokenizer.json, tokenizer_config.json)")
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # transformers raises many kinds; the user needs one sentence
        where = f"{_origin(ns, 'hf_checkpoint')} {path}" if path else "the default tokenizer"
        raise UsageError(f"{where}: cannot load a tokenizer there ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
    try:
        profile = make_profile(cfg.profile, tokenizer, tool_parser=cfg.tool_parser, reasoning_parser=cfg.reasoning_parser,
                           template_kwargs=cfg.chat_template_kwargs)
    except Exception as exc:
        if cfg.tool_parser is not None and str(exc).startswith("unknown tool parser"):
            raise UsageError(f"{_origin(ns, 'engine_tool_parser')}: {exc}") from None
        if cfg.reasoning_parser is not None and ("reasoning parser" in str(exc) or "engine_reasoning_parser" in str(exc)):
            raise UsageError(f"{_origin(ns, 'engine_reasoning_parser')}: {exc}") from None
        raise UsageError(f"{_origin(ns, 'engine_profile')} {cfg.profile}: {exc}") from None
    if cfg.compaction != "off" and not callable(getattr(profile, "render_messages", None)):
        from engine.loop.runtime import compaction_needs_chat

        raise UsageError(f"{_origin(ns, 'engine_compaction')} {cfg.compaction}: {compaction_needs_chat(cfg.profile)}")
    return tokenizer


def check_tools(ns: argparse.Namespace, cfg: EngineConfig) -> list[str]:
    """Import the tool modules, check the tool names; returns the tools offered."""
    from engine import tools

    from engine.tools import mcp_servers

    mcp = cfg.plugin(mcp_servers.McpSettings)
    if mcp.servers:  # the tool modules are imported by now (`settings_args`)
        try:
            mcp_servers.register_servers(mcp.servers, mcp.list_timeout, cfg.tool_timeout)
        except ValueError as exc:
            raise UsageError(f"{_origin(ns, 'engine_mcp_servers')}: {exc}") from None
    check_environment(ns, cfg)
    registered = tools.names()
    unknown = [n for n in cfg.tools or () if n not in registered]
    if unknown:
        raise UsageError(f"{_origin(ns, 'engine_tools')}: no tool named {', '.join(map(repr, unknown))} "
                         f"(registered: {', '.join(registered) or 'none'}; add one with --tool-module)")
    return [n for n in registered if cfg.tools is None or n in cfg.tools]


def check_environment(ns: argparse.Namespace, cfg: EngineConfig) -> None:
    """The environment must be registered (after the tool modules are imported) and set up."""
    if cfg.environment is not None:
        _check_named_environment(cfg, cfg.environment, _origin(ns, "engine_environment"))


def check_sample_environments(cfg: EngineConfig, samples: list[Sample]) -> None:
    """Every environment the input's lines name (`metadata["environment"]`) is registered and sets up."""
    from engine import envs
    from engine.loop.environment import UnknownEnvironment, read_choice

    named: dict[str, int] = {}
    for sample in samples:
        try:
            name = read_choice(sample.metadata).name
        except UnknownEnvironment:
            continue  # that sample ends bad_sample_input, with the reason: not the run's to refuse
        if name is not None and name != envs.NONE and name not in named:
            named[name] = sample.index if sample.index is not None else 0
    for name, index in named.items():
        _check_named_environment(cfg, name, f"--input (the sample at position {index})")


def _check_named_environment(cfg: EngineConfig, name: str, origin: str) -> None:
    """UsageError, saying where the name came from, unless the environment `name` is registered and sets up."""
    from engine import envs

    env = envs.get_environment(name)
    if env is None:
        raise UsageError(f"{origin}: no environment named {name!r} "
                         f"(registered: {', '.join(envs.environment_names()) or 'none'}; add one with --tool-module)")
    try:
        cfg.set_up(env)
    except Exception as exc:
        raise UsageError(f"{origin} {name}: {exc}") from None


def check_budgets(ns: argparse.Namespace, cfg: EngineConfig, max_new_tokens: int) -> None:
    """The budgets must fit in one another."""
    if cfg.max_context_len is None:
        return
    if max_new_tokens > cfg.max_context_len:
        raise UsageError(f"{_origin(ns, 'rollout_max_response_len')} {max_new_tokens} is more than "
                         f"{_origin(ns, 'rollout_max_context_len')} {cfg.max_context_len}: a turn cannot outgrow the context")
    if cfg.max_response_len is not None and cfg.max_response_len > cfg.max_context_len:
        raise UsageError(f"{_origin(ns, 'engine_max_response_len')} {cfg.max_response_len} is more than "
                         f"{_origin(ns, 'rollout_max_context_len')} {cfg.max_context_len}")


def check_agent(ns: argparse.Namespace, cfg: EngineConfig) -> None:
    """The agent must be nameable and its profile render chat messages (chat)."""
    from engine.agent.harness import HarnessSpec

    try:
        spec = HarnessSpec.parse(cfg.agent or "")
    except ValueError as exc:
        raise UsageError(f"{_origin(ns, 'engine_agent')}: {exc}") from None
    # What cannot start would crash every sample alike: said once, before any is rolled out.
    if spec.kind == "python":
        try:
            spec.function()
        except Exception as exc:  # the user's module: any failure of its import is theirs to read
            raise UsageError(f"{_origin(ns, 'engine_agent')}: {spec.target}: {type(exc).__name__}: {exc}") from None
    elif shutil.which(spec.argv[0]) is None:
        raise UsageError(f"{_origin(ns, 'engine_agent')}: {spec.argv[0]}: no such program (not a file, nor on PATH)")
    if cfg.profile != "chat":
        raise UsageError(f"{_origin(ns, 'engine_agent')}: an agent needs the chat profile "
                         f"({_origin(ns, 'engine_profile')} is {cfg.profile})")


def plan_run(ns: argparse.Namespace) -> Plan:
    """Check every argument, cheapest first; raises UsageError (or CannotRun for a dead tool)."""
    prompts, demo_script, demo_settings = DEMOS[getattr(ns, "demo", None) or "tools"]
    if demo_settings:
        if ns.config:
            raise UsageError(f"--config: --demo {ns.demo} runs with its own settings ({demo_file(demo_settings)}); "
                             "give yours as flags, or copy that file and drop --demo")
        ns.config = demo_file(demo_settings)
    in_path = ns.input or demo_file(prompts)
    check_output(ns.output, in_path)
    try:
        args = settings_args(ns)
        cfg = EngineConfig.from_args(args)
        sampling = sources.read(Sampling, args)
    except SettingsError as exc:  # the sentence names the key: say where the user set it instead
        key, _, rest = str(exc).partition(" ")
        if key not in declared_keys():
            raise UsageError(str(exc)) from None
        raise UsageError(f"{_origin(ns, key)}{':' if rest.startswith('must ') else ''} {rest}") from None
    check_budgets(ns, cfg, sampling.rollout_max_response_len)
    server = ns.server or getattr(args, "engine_server_url", None)
    if server and ns.replay:
        raise UsageError("--replay: only the embedded server replays a script; drop --replay or --server")
    replay = None
    if not server:
        replay = ns.replay or (demo_file(demo_script) if demo_script else demo_replay(cfg.profile, cfg.tool_parser))
        try:
            from engine.local.server.replay import load_replay

            load_replay(replay)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--replay {replay}: {getattr(exc, 'strerror', None) or exc}") from None
    samples = expand_groups(read_input(in_path, ns.limit), sampling.n_samples_per_prompt)
    offered = check_tools(ns, cfg)  # first: a tool module may register the profile or parser named
    check_sample_environments(cfg, samples)
    tokenizer = check_tokenizer(ns, cfg)
    if cfg.agent is not None:
        check_agent(ns, cfg)
    else:  # an agent runs its own tools: the engine's are not offered
        from engine.loop.preflight import check_tools_sync, describe

        problems = check_tools_sync(offered)
        if problems:
            raise CannotRun(f"{describe(problems)}; nothing was rolled out")
    params = {"temperature": sampling.rollout_temperature, "top_p": sampling.rollout_top_p,
              "max_new_tokens": sampling.rollout_max_response_len, "no_stop_trim": True,
              "skip_special_tokens": False, "spaces_between_special_tokens": False}
    progress = not ns.no_progress and sys.stderr.isatty()
    return Plan(cfg, samples, params, ns.output, server, replay, tokenizer, progress,
                tuple(offered) if cfg.agent is None else ())  # an agent runs its own tools


SANDBOXED_TOOLS = ("code_interpreter", "python_session")  # the built-in tools that run model code in the sandbox


def sandbox_line(plan: Plan) -> str | None:
    """Which sandbox mode the run's model code gets, in one line (None when no offered tool runs code).

    The preflight has probed the sandbox already (cached): this reads its answer, runs nothing.
    """
    if not set(SANDBOXED_TOOLS) & set(plan.tools):
        return None
    if plan.cfg.sandbox_backend != "local":
        return f"sandbox: model code runs on the {plan.cfg.sandbox_backend} backend's workers (engine_sandbox_backend)"
    from engine.sandbox import probe_sync

    isolation = probe_sync().isolation
    layers = [name for name, on in (("Landlock", isolation.get("landlock")), ("seccomp", isolation.get("seccomp"))) if on]
    held = "; not held here: " + "; ".join(isolation["cannot_hold"]) if isolation.get("cannot_hold") else ""
    return (f"sandbox: {isolation.get('mode', 'mode unknown')}, with {' and '.join(layers) or 'no Landlock or seccomp'}"
            f"{held} (docs/sandbox-modes.md)")


def replay_line(plan: Plan) -> str | None:
    """A warning when prompts of the input hold no replay entry's prompt (None when all do, or no replay plays).

    The embedded model is tiny and untrained: a prompt the script does not know is sampled
    freely, noise up to the turn's cap, which looks like a broken harness or format.
    """
    if plan.replay is None:
        return None
    from engine.local.server.replay import load_replay

    known = [entry.prompt for entry in load_replay(plan.replay).entries]
    prompts = [text for text in dict.fromkeys(_prompt_words(s.prompt) for s in plan.samples) if text]
    unknown = sum(not any(p in text for p in known) for text in prompts)
    if not unknown:
        return None
    return (f"warning: {unknown} of {len(prompts)} prompts hold no prompt of the replay script {os.path.basename(plan.replay)}: "
            "the embedded model (tiny, untrained) samples their turns freely, noise up to each turn's cap "
            "(--replay FILE teaches it yours: docs/without-slime.md#replay-scripts)")


def _prompt_words(prompt: Any) -> str:
    """A prompt's text: itself, or its chat messages' contents one a line."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return str(prompt)


# -- the server ---------------------------------------------------------------------------------


def server_context_length(url: str) -> int | None:
    """The server's context length from `/server_info` (or its old alias); None if not told."""
    for route in ("/server_info", "/get_server_info"):
        try:
            info = request_once("GET", url.rstrip("/") + route, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("context_length"), int):
            return info["context_length"]
    return None


def check_reachable(url: str) -> str | None:
    """None when the server answers `/health`, else a sentence saying what went wrong."""
    try:
        request_once("GET", url.rstrip("/") + "/health", timeout=10)
    except httpx.HTTPError as exc:
        return f"cannot reach the server at {url}: {type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def embedded_server(plan: Plan) -> Iterator[str]:
    """Start the demo server on a free loopback port unless a server URL was given."""
    if plan.server:
        yield plan.server
        return
    from engine.local.server import BackgroundServer, ServerSettings

    print(f"starting the embedded server (tiny Qwen3 on the CPU, replay {os.path.basename(str(plan.replay))})...", file=sys.stderr)
    server = BackgroundServer(ServerSettings(port=0, replay_path=plan.replay, tokenizer_path=plan.cfg.tokenizer_path))
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        cause = exc.__cause__ or exc
        raise CannotRun(f"the embedded server did not start: {type(cause).__name__}: {cause}") from None
    try:
        yield server.url
    finally:
        server.stop()


# -- rolling out --------------------------------------------------------------------------------


async def roll_out(plan: Plan, cfg: EngineConfig, out_path: str) -> int:
    """Run every pending sample; append each finished one to `out_path` as it ends. Returns the retries."""
    from engine.loop.runtime import Runtime
    from engine.slime import reward_func, run_agent_sample, run_sample

    rt = Runtime.create(cfg, tokenizer=plan.tokenizer)
    gate = asyncio.Semaphore(cfg.max_connections)
    bar = None
    if plan.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan.samples), unit="sample", file=sys.stderr)
    with open(out_path, "w", encoding="utf-8") as out:

        def emit(sample: Sample) -> None:
            out.write(json.dumps(sample.to_dict(), ensure_ascii=False) + "\n")
            out.flush()
            if bar is not None:
                bar.update(1)

        async def one(sample: Sample) -> None:
            async with gate:
                if cfg.agent is not None:  # the agent's segments: one sample each
                    out = await run_agent_sample(rt, sample, dict(plan.params))
                else:  # a sample, or its segments (or turns) where samples fan out
                    out = await run_sample(rt, sample, dict(plan.params))
                done = out if isinstance(out, list) else [out]
                for each in done:
                    if each.status.name in ("COMPLETED", "TRUNCATED", "FAILED") and each.reward is None:
                        each.reward = await reward_func(None, each)
            for each in done:
                emit(each)

        for sample in plan.samples:
            if sample.status is not Sample.Status.PENDING:
                emit(sample)  # a bad input line: recorded, not rolled out
        tasks = [asyncio.create_task(one(s)) for s in plan.samples if s.status is Sample.Status.PENDING]
        terminated, before = _cancel_on_sigterm()
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            if not terminated:
                raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if cfg.agent is not None:
                from engine.agent.serving import close_served

                await close_served(rt)
            await rt.aclose()
            if bar is not None:
                bar.close()
            _restore_sigterm(before)
        if terminated:
            raise Terminated()
    return int(rt.client.retries_spent)


def _cancel_on_sigterm() -> tuple[list[int], Any]:
    """On SIGTERM, cancel the running rollout (its samples end as on Ctrl-C): the list says it came;
    with the handler it replaced, for `_restore_sigterm`."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return came, None
    task = asyncio.current_task()
    assert task is not None

    def stop() -> None:
        came.append(signal.SIGTERM)
        task.cancel()

    before = signal.getsignal(signal.SIGTERM)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
    return came, before


def _restore_sigterm(before: Any) -> None:
    """Put back the handler the loop's replaced (removing the loop's own leaves SIGTERM at its default)."""
    if threading.current_thread() is threading.main_thread():
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def finish_output(partial: str, output: str) -> list[dict[str, Any]]:
    """Put the finished samples in input order under OUTPUT (atomically); returns them."""
    with open(partial, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda row: (row.get("index") is None, row.get("index") or 0))
    ordered = partial + ".ordered"
    with open(ordered, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(ordered, output)
    os.remove(partial)
    return rows


def main_run(ns: argparse.Namespace) -> int:
    """`python -m engine run`: see the module docstring."""
    try:
        plan = plan_run(ns)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CannotRun as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for line in (sandbox_line(plan), replay_line(plan)):
        if line:
            print(line, file=sys.stderr)
    with sigterm_as_interrupt():
        return _run_planned(plan)


def _run_planned(plan: Plan) -> int:
    partial = plan.output + ".partial"
    interrupted: int | None = None  # the exit status of an interrupted run
    retries = None
    started = time.perf_counter()
    try:
        with embedded_server(plan) as url:
            problem = check_reachable(url)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return EXIT_USAGE
            try:  # the server's context may refuse a setting measured against it (a compaction threshold)
                cfg = attrs.evolve(plan.cfg, server_url=url.rstrip("/"),
                                   max_context_len=plan.cfg.max_context_len or server_context_length(url))
            except SettingsError as exc:
                print(f"error: {exc} (the server's context)", file=sys.stderr)
                return EXIT_USAGE
            started = time.perf_counter()
            retries = asyncio.run(roll_out(plan, cfg, partial))
    except CannotRun as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C: keep what finished, under the final name
        interrupted = EXIT_INTERRUPTED
    except Terminated:  # SIGTERM: the same
        interrupted = EXIT_TERMINATED
    wall = time.perf_counter() - started
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # writing OUTPUT takes moments: a second SIGTERM waits
    if interrupted == EXIT_TERMINATED:
        print("terminated (SIGTERM): keeping the samples that finished", file=sys.stderr)
    if os.path.exists(partial) and os.path.getsize(partial) == 0:
        os.remove(partial)  # opened, but nothing finished before the interruption
    if not os.path.exists(partial):
        print("interrupted before any sample finished: nothing written", file=sys.stderr)
        return interrupted or EXIT_INTERRUPTED
    done = finish_output(partial, plan.output)
    return report(done, plan, wall, retries, interrupted)


def config_keys(ns: argparse.Namespace) -> dict[str, Any]:
    """The run's --config YAML as read ({} without one, or when unreadable: plan_run says why)."""
    if not getattr(ns, "config", None):
        return {}
    try:
        return sources.load_yaml_settings(ns.config)
    except SettingsError:
        return {}


def main_agent(ns: argparse.Namespace) -> int:
    """`python -m engine agent [options] -- CMD ...`: `run` with an agent per prompt.

    CMD (everything after `--`) is the harness's command line; without one (and without an
    `engine_agent` from --agent or the --config YAML), the demo's agent
    (`engine.local.agent_demo`) runs the demo's prompts against the embedded server, whose
    replay teaches it the task. The profile is chat unless set.
    """
    command = list(ns.command or [])
    if command[:1] == ["--"]:
        command = command[1:]
    configured = config_keys(ns)
    demo = not command and ns.agent is None and configured.get("engine_agent") is None
    if command:
        ns.agent = shlex.join(command)
    elif demo:
        if importlib.util.find_spec("openai") is None:  # else each sample ends harness_crashed, one by one
            print("error: the demo's agent talks through the openai SDK, which is not installed: "
                  "pip install -e '.[agent]' in the engine's checkout (or give your harness's command after --)",
                  file=sys.stderr)
            return EXIT_FAILED
        ns.agent = shlex.join([sys.executable, "-m", "engine.local.agent_demo"])
    if demo or ns.input is None:
        ns.input = ns.input or demo_file("agent-prompts.jsonl")
    if ns.replay is None and not ns.server and not configured.get("engine_server_url"):
        ns.replay = demo_file("replay-agent.jsonl")
    if ns.profile is None:
        ns.profile = "chat"
    return main_run(ns)


def report(done: list[dict[str, Any]], plan: Plan, wall: float, retries: int | None, interrupted: int | None) -> int:
    """Print the summary; the exit status says whether the batch as a whole failed (or how it was stopped)."""
    from engine.profiles.tokenizer import Codec
    from engine.trace.summary import batch_failure, format_summary, summarize

    summary = summarize(done, wall_seconds=wall, decode=Codec(plan.tokenizer).decode, retries=retries)
    print(format_summary(summary))
    how = {EXIT_INTERRUPTED: "interrupted", EXIT_TERMINATED: "terminated by SIGTERM"}.get(interrupted or 0)
    note = f" ({how}: the rest were not run)" if how else ""
    print(f"\nwrote {len(done)} sample(s) to {plan.output}{note}")
    if interrupted is not None:
        return interrupted
    failure = batch_failure(summary)
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return EXIT_FAILED
    return 0


__all__ = ["CannotRun", "Plan", "UsageError", "expand_groups", "flag_keys", "main_agent", "main_run", "plan_run",
           "read_prompts", "run_defaults", "settings_args"]
