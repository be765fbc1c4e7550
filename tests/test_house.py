"""The plan of the house: what a slime job imports, no import circles, pinned faces, tool names.

These pin the layout's rules, so a change that breaks one fails here and not in a slime job.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine import tools
from engine.machine.states import STATES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine",)


def test_a_slime_job_imports_no_torch_aiohttp_pygraphviz_nor_the_local_or_trace_packages_nor_the_agent_door() -> None:
    code = (
        "import json, sys; import engine.slime; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'aiohttp', 'pygraphviz', 'openai', 'anthropic') "
        "or m.startswith(('engine.local', 'engine.trace', 'engine.agent.app', 'engine.agent.chat', "
        "'engine.agent.responses', 'engine.agent.messages', 'engine.agent.shapes')))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_tool_authors_package_loads_nothing_else_of_the_engine() -> None:
    """A tool author imports `engine.tools` (and through it the sandbox, and the settings' declarations a
    plugin declares its own with): not the loop, the wire or httpx."""
    code = ("import json, sys; import engine.tools; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'httpx' or (m.startswith('engine.') "
            "and not m.startswith(('engine.tools', 'engine.sandbox', 'engine.settings', 'engine.logs'))))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_sandbox_loads_nothing_else_of_the_engine() -> None:
    """The sandbox's own processes (zygote, child) import `engine.sandbox` alone: not the tool API, the loop or httpx."""
    code = ("import json, sys; import engine.sandbox, engine.sandbox.zygote, engine.sandbox.child; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'httpx' or (m.startswith('engine.') "
            "and not m.startswith('engine.sandbox')))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules that `path` imports anywhere: at module level, inside functions
    (lazy imports) and under TYPE_CHECKING alike, so a circle cannot hide in a deferred import."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) - {_module_name(p)} for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_the_projects_modules() -> None:
    graph = import_graph()
    assert "engine.machine.table" in graph and graph["engine.machine.table"] >= {"engine.machine.actions"}
    assert cycles(graph) == []


def test_the_machine_imports_neither_the_loop_nor_the_adapter_nor_the_looking_back() -> None:
    graph = import_graph()
    machine = [m for m in graph if m.startswith("engine.machine")]
    reached = {dep for m in machine for dep in graph[m]}
    assert not {d for d in reached if d.startswith(("engine.loop", "engine.slime", "engine.trace", "engine.local"))}


def test_tools_knows_nothing_of_the_engine() -> None:
    """`engine.tools` (the tool author's API) lives inside the engine's name only so that no `tools/`
    folder of a user's (slime's checkout has one) can shadow it; it imports nothing else of the engine
    but the sandbox its built-ins run code in and the settings a plugin declares its own with (which
    import only the sandbox), and the sandbox imports nothing else of the engine at all."""
    graph = import_graph()
    tool_modules = [m for m in graph if m == "engine.tools" or m.startswith("engine.tools.")]
    assert "engine.tools.registry" in tool_modules
    allowed = ("engine.tools", "engine.sandbox", "engine.settings", "engine.logs")
    assert not {d for m in tool_modules for d in graph[m] if not d.startswith(allowed)}
    settings = [m for m in graph if m.startswith(("engine.settings", "engine.logs"))]
    assert not {d for m in settings for d in graph[m] if not d.startswith(("engine.settings", "engine.sandbox", "engine.logs"))}
    sandbox = [m for m in graph if m == "engine.sandbox" or m.startswith("engine.sandbox.")]
    assert "engine.sandbox.runner" in sandbox
    assert not {d for m in sandbox for d in graph[m] if not d.startswith("engine.sandbox")}


@pytest.mark.parametrize("module, expected", [
    (engine, ["EngineConfig", "Profile", "RetryPolicy", "Runtime", "generate", "log_rollout", "register_profile",
              "reward_func", "roll_out", "roll_out_all", "sampling_params"]),
    (tools, ["Tool", "ToolError", "ToolResult", "ToolUnavailable", "call_timeout", "count", "get", "names", "register", "tool"]),
])
def test_the_faces_export_a_deliberate_list(module: object, expected: list[str]) -> None:
    exported = sorted(getattr(module, "__all__"))
    assert exported == sorted(expected)
    for name in exported:  # the face may import its names on first use
        getattr(module, name)
    public = {n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, type(sys))}
    assert public == set(exported), "a public name that is not in __all__ (or the reverse)"


@pytest.mark.parametrize("name", ["call"])
def test_a_tool_named_after_a_core_state_is_refused_at_registration(name: str) -> None:
    core = {d.name for d in STATES}
    assert f"TOOL_{name.upper()}" in core

    with pytest.raises(ValueError, match=r"'call' would get the state TOOL_CALL, which is a core state"):

        @tools.tool
        async def call(x: str) -> str:
            return x

    assert "call" not in tools.names()


@pytest.mark.parametrize("name", ["", "Bad", "has space", "1abc", "_x", "ünï", "a-b"])
def test_a_name_that_cannot_form_a_state_is_refused(name: str) -> None:
    class Named(tools.Tool):
        async def execute(self, session: object, **arguments: object) -> str:
            return ""

    tool = Named()
    tool.name = name  # type: ignore[misc]
    with pytest.raises(ValueError, match="tool name must be lowercase letters"):
        tools.register(tool)
    assert name not in tools.names()


# A dependency's private name is read in one compat module, which says which versions it was checked with.
PRIVATE_NAMES = {
    "ray._private": "engine/local/ray_compat.py",
    "_instances": "engine/slime/compat.py",  # slime's singleton registry
}


@pytest.mark.parametrize("name, home", sorted(PRIVATE_NAMES.items()))
def test_a_private_name_of_a_dependency_lives_in_its_compat_module_alone(name: str, home: str) -> None:
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py")
                   if name in p.read_text(encoding="utf-8"))
    assert found == [home]
