"""docs/settings.md, made from the declarations: `python -m engine settings [--out PATH [--check]]`.

One table per group of keys: the engine's own, slime's arguments it reads, those only `run` reads,
and one per plugin shipped with the engine (`--tool-module` adds a researcher's plugins to the page).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from engine.settings.core import BUILT_IN_PLUGINS, EngineConfig, Sampling, load_plugins
from engine.settings.declare import Setting, SettingsError, number_text, plugins, rows, title_of
from engine.settings.sources import ENGINE_PREFIX

SETTINGS_PAGE = "docs/settings.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(table: Iterable[Setting]) -> str:
    """The Markdown table of `table`: key, what it accepts, default (and `run`'s), flag, meaning."""
    lines = ["| key | accepts | default | `run` flag | meaning |", "|---|---|---|---|---|"]
    for s in table:
        default = s.default_text()
        if s.flag is not None or s.run_default is not None:
            ran = s.default_text(for_run=True)
            if ran != default:
                default += f" (`run`: {ran})"
        flag = f"`{s.flag.name}`" if s.flag is not None else ""
        cap = f"; above {number_text(s.high)} lowered to it" if s.cap and s.high is not None else ""
        lines.append(f"| `{s.key}` | {_cell(s.allowed() + cap)} | {_cell(default)} | {flag} | {_cell(s.help)} |")
    return "\n".join(lines)


def sections(modules: Iterable[str] = ()) -> list[tuple[str, str, list[Setting]]]:
    """(title, words, settings) of every table: the engine's, then each plugin's (shipped, and `modules`')."""
    modules = tuple(modules)
    load_plugins(modules)
    core = [r for r in rows(EngineConfig) if r.key]
    parts = [
        ("Engine settings", "Set in the YAML of slime's `--custom-config-path` (or `python -m engine run --config`).",
         [r for r in core if r.key.startswith(ENGINE_PREFIX)]),  # type: ignore[union-attr]
        ("slime's arguments the engine reads",
         "slime's own flags (`--sglang-router-ip` is `sglang_router_ip`); the engine reads them as slime set them.",
         [r for r in core if not r.key.startswith(ENGINE_PREFIX)]),  # type: ignore[union-attr]
        ("slime's arguments only `run` reads",
         "slime checks these itself in a training job; `python -m engine run` reads them from its flags or `--config`.",
         list(rows(Sampling))),
    ]
    sources = (*BUILT_IN_PLUGINS, *modules)
    shown = [p for p in plugins() if p.__module__.startswith(sources)]  # not whatever else this process imported
    # in the order of `sources`, whichever this process happened to import first
    shown.sort(key=lambda plugin: next(i for i, source in enumerate(sources) if plugin.__module__.startswith(source)))
    for plugin in shown:
        words = (f"A plugin's settings (`{plugin.__module__}.{plugin.__qualname__}`), "
                 f"under its prefix `{plugin.__settings_prefix__}`.")
        parts.append((title_of(plugin), words, [r for r in rows(plugin) if r.key]))
    return parts


def settings_page(modules: Iterable[str] = ()) -> str:
    """docs/settings.md, every word of it made from the declarations (`python -m engine settings --out docs/settings.md`)."""
    parts = [
        "# Settings",
        "",
        ("<!-- Generated from the settings' declarations (engine/settings/core.py, and each plugin's) by "
         "`python -m engine settings --out docs/settings.md`; a test keeps it current. Do not edit by hand. -->"),
        "",
        ("Every key the engine reads, as slime hands it over (the keys of `--custom-config-path` become "
         "attributes of slime's `args`). A value of the wrong kind or outside its range ends every sample with "
         "`engine_setup_failed` and one sentence naming the key and what it accepts; `python -m engine run` "
         "says the same sentence and exits 2; a directly built `EngineConfig(...)` raises it. An `engine_*` key "
         "nothing declares is warned about once, with the closest declared key; in `run --config` every unknown key is."),
        "",
        ("`python -m engine run` reads the same keys from `--config` (a YAML as slime's) and from its flags; "
         "a flag wins over the file. Where `run`'s default differs from a training job's, both are shown."),
        "",
        ("To add a setting: one field `name: type = setting(default, help=..., ...)` in `EngineConfig` "
         "(engine/settings/core.py); `flag=Flag(...)` offers it in `run`. A plugin (a tool, an environment) declares "
         "its own the same way in a class of its own, under its own prefix (`@settings(prefix=\"engine_myenv_\")`), "
         "names it as its `Settings` and gets the instance in `setup` (docs/tools.md, docs/environments.md). "
         "Then `python -m engine settings --out docs/settings.md`."),
    ]
    for title, words, table in sections(modules):
        parts += ["", f"## {title}", "", words, "", settings_table(table)]
    return "\n".join(parts) + "\n"


def main_settings(ns: Any) -> int:
    """`python -m engine settings`: print the tables, or write (`--out`) or check (`--check`) the page."""
    try:
        page = settings_page(getattr(ns, "tool_modules", None) or ())
    except SettingsError as exc:
        print(f"error: {str(exc).replace('engine_tool_modules', '--tool-module', 1)}", file=sys.stderr)
        return 2
    if not ns.out:
        if ns.check:
            print("error: --check needs --out PATH (the page to check)", file=sys.stderr)
            return 2
        print(page, end="")
        return 0
    if ns.check:
        try:
            with open(ns.out, encoding="utf-8") as f:
                current = f.read() == page
        except OSError:
            current = False
        if not current:
            print(f"error: {ns.out} is not current: run python -m engine settings --out {ns.out}", file=sys.stderr)
            return 1
        return 0
    try:
        with open(ns.out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        print(f"error: --out {ns.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out}")
    return 0
