"""Drawing the machine from its definition: Mermaid text, an SVG, and the checked-in `diagrams/`.

The drawing is built straight from `MachineSpec` rather than through `transitions`'
GraphMachine: the spec already holds every state and edge with its guard name, a
GraphMachine would label guards by the wrapped callables (lambdas here), needs a model
attached, and can highlight only the current state and last edge, not a whole path with
counts. Mermaid and Graphviz are both rendered from one list of nodes and lines, in spec
order, so the output is the same every run.

`python -m engine trace` and `flow` draw the same machine with an `Overlay` (see
engine/sample_paths.py) highlighting the edges and states samples took.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import attrs

from engine.machine import RESET, TERMINALS, MachineSpec, fault_edges, tool_state
from engine.sample_paths import (
    EdgeKey,
    Overlay,
    edge_counts,
    edge_key,
    flow_overlay,
    flow_table,
    timeline,
    trace_overlay,
)
from engine.samples_file import fsm_trace, load_samples, select_sample

__all__ = [
    "Overlay",
    "builtin_spec",
    "edge_counts",
    "machine_mermaid",
    "machine_svg",
    "main_diagram",
    "main_flow",
    "main_trace",
    "load_samples",
    "readme_text",
    "spec_for_samples",
    "stale_diagrams",
    "timeline",
    "write_diagrams",
]

FILES = ("machine.mmd", "machine.svg", "README.md")
ANY = "ANY"  # the pseudo-state the compact drawing folds the fault edges into
# Every trigger `fault_edges` can add, read from the definition rather than listed here.
FAULT_TRIGGERS = frozenset(e.trigger for e in fault_edges(["S"], {"S"}))

LEGEND = {
    "RESET": "forgets what an earlier attempt left on the sample, renders the prompt and starts from it alone",
    "BUDGET_CHECK": "before each turn: ends TRUNCATED if context, per-turn cap or turns are spent, else clamps max_new_tokens to the room left",
    "GENERATE": "one /generate request; the reply's ids and logprobs are taken as sent, then the turn is parsed (answer, tool call, invalid)",
    "TOOL_CALL": "plans the turn's calls (surplus or unparsable ones get an error answer), hands them to the tool states, appends the observation (mask 0)",
    "TRIM": "cuts every per-token array to the budget together after a reply or an observation overflowed it",
    "COMPLETED": "terminal: the model gave its final answer",
    "TRUNCATED": "terminal: a budget ran out (context, turns, tool calls) or the turn hit its max_new_tokens",
    "ABORTED": "terminal: an unusable reply, a server abort, a failed request, a cancellation, or a broken invariant (response discarded)",
    "FAILED": "terminal: an engine error, or a request the server rejected",
}

# -- which machine -------------------------------------------------------------------


@cache
def builtin_tool_names() -> tuple[str, ...]:
    """The tools a fresh `import tools` registers: what `python -m engine diagram` draws.

    Asked of a fresh interpreter so that tools a test (or a caller) registered in this
    process never leak into the checked-in diagrams or their staleness check.
    """
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    code = "import json, tools; print(json.dumps(list(tools.names())))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"importing the tools package failed:\n{done.stderr}")
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def builtin_spec() -> MachineSpec:
    """The machine with the built-in tools registered."""
    return MachineSpec.from_registry(tool_names=builtin_tool_names())


def spec_for_samples(samples: Sequence[dict[str, Any]]) -> MachineSpec:
    """The built-in machine plus a state for every other tool the samples' traces passed through."""
    names = set(builtin_tool_names())
    for sample in samples:
        for step in fsm_trace(sample):
            names.update(s.removeprefix("TOOL_").lower() for s in step[:3:2] if s.startswith("TOOL_") and s != "TOOL_CALL")
    return MachineSpec.from_registry(tool_names=tuple(sorted(names)))


# -- one drawing, two renderers -------------------------------------------------------


@attrs.frozen
class _Line:
    source: str
    dest: str
    label: str
    key: EdgeKey | None  # None for the compact fold's summary lines
    fault: bool = False
    extra: bool = False  # taken by a sample but not an edge of this machine
    marked: bool = False


def _describe(states: Sequence[str], spec: MachineSpec) -> str:
    """Name a set of source states briefly: a short list, or "every state but ..."."""
    rest = [s for s in spec.states if s not in states]
    if len(states) <= 3:
        return ", ".join(states)
    return "every state but " + ", ".join(rest) if rest else "every state"


def _lines(spec: MachineSpec, overlay: Overlay | None, compact: bool) -> list[_Line]:
    marks = overlay.edges if overlay else {}
    lines: list[_Line] = []
    folded: dict[tuple[str, str], list[str]] = {}
    for e in spec.edges:
        key = edge_key(e)
        fault = e.trigger in FAULT_TRIGGERS
        if compact and fault and key not in marks:  # a taken fault edge stays drawn
            folded.setdefault((e.trigger, e.dest), []).append(e.source)
            continue
        note = marks.get(key)
        label = f"{e.label} {note}" if note else e.label
        lines.append(_Line(e.source, e.dest, label, key, fault=fault, marked=note is not None))
    known = {edge_key(e) for e in spec.edges}
    for key, note in marks.items():
        if key not in known:
            lines.append(_Line(key[0], key[2], f"{key[1]} (not in this machine) {note}", key, extra=True, marked=True))
    for (trigger, dest), sources in folded.items():
        lines.append(_Line(ANY, dest, f"{trigger} (from {_describe(sources, spec)})", None, fault=True))
    return lines


def _states(spec: MachineSpec, overlay: Overlay | None, lines: list[_Line]) -> list[str]:
    states = list(spec.states)
    extra = [s for ln in lines for s in (ln.source, ln.dest) if s not in states and s != ANY]
    if overlay:
        extra += [s for s in overlay.states if s not in states]
    return states + list(dict.fromkeys(extra)) + ([ANY] if any(ln.source == ANY for ln in lines) else [])


# -- Mermaid -------------------------------------------------------------------------

_MERMAID_CLASSES = {
    "terminal": "fill:#e9ecef,stroke:#495057,stroke-width:2px",
    "tool": "fill:#e7f5ff,stroke:#1c7ed6",
    "fault": "fill:#fff,stroke:#868e96,stroke-dasharray:4 4,color:#868e96",
    "visited": "fill:#ffe8cc,stroke:#e8590c,stroke-width:3px",
    "visitedTerminal": "fill:#ffc078,stroke:#d9480f,stroke-width:4px,font-weight:bold",
}


def _mermaid_text(text: str) -> str:
    # A transition's text ends at ':' or ';' in mermaid's grammar, and '#' starts an entity.
    return text.replace(":", "").replace(";", ",").replace("#", "")


def machine_mermaid(spec: MachineSpec, overlay: Overlay | None = None, *, compact: bool = False) -> str:
    """A Mermaid `stateDiagram-v2` of the machine; with `overlay`, its marked states and edges highlighted.

    Every edge is one `SOURCE --> DEST : trigger [guard]` line, in spec order, followed
    by the overlay's note (e.g. "×3"). `compact` folds the fault edges (crashed,
    cancelled, invariant_violated from every state) into one pseudo-state `ANY`.
    """
    lines = _lines(spec, overlay, compact)
    states = _states(spec, overlay, lines)
    out = []
    if overlay and overlay.title:
        out += ["---", f"title: {json.dumps(_mermaid_text(overlay.title), ensure_ascii=False)}", "---"]
    out += ["stateDiagram-v2", "    %% drawn from engine/machine.py by engine/diagrams.py: do not edit by hand"]
    out += [f"    classDef {name} {style}" for name, style in _MERMAID_CLASSES.items()]
    if ANY in states:
        out.append('    state "any state (fault edges)" as ANY')
    out.append(f"    [*] --> {RESET}")
    out += [f"    {ln.source} --> {ln.dest} : {_mermaid_text(ln.label)}" for ln in lines]
    out += [f"    {s} --> [*]" for s in states if s in TERMINALS]
    if overlay:
        out += [f"    {s} : {_mermaid_text(note)}" for s, note in overlay.states.items() if note]
    classes: dict[str, list[str]] = {}
    for s in states:
        marked = overlay is not None and s in overlay.states
        if marked:
            cls = "visitedTerminal" if s in TERMINALS else "visited"
        else:
            cls = "terminal" if s in TERMINALS else "tool" if s in spec.tool_states else "fault" if s == ANY else ""
        if cls:
            classes.setdefault(cls, []).append(s)
    out += [f"    class {','.join(names)} {cls}" for cls, names in classes.items()]
    return "\n".join(out) + "\n"


# -- Graphviz SVG --------------------------------------------------------------------

_INK, _DIM, _HOT, _HOT_TEXT = "#343a40", "#adb5bd", "#e8590c", "#d9480f"


def _edge_id(key: EdgeKey | None, n: int) -> str:
    """An XML-safe id naming the edge: source, label (trigger and guard), dest."""
    if key is None:
        return f"fold{n}"
    return "edge:" + ":".join(re.sub(r"[^A-Za-z0-9_]+", "_", part).strip("_") for part in key)


def machine_dot(spec: MachineSpec, overlay: Overlay | None = None, *, compact: bool = False) -> Any:
    """The drawing as a `pygraphviz.AGraph` (not laid out)."""
    import pygraphviz  # lazily: the Graphviz libraries load only when an SVG is drawn

    lines = _lines(spec, overlay, compact)
    g = pygraphviz.AGraph(directed=True, strict=False, name="machine")
    g.graph_attr.update(rankdir="TB", nodesep="0.35", ranksep="0.5", fontname="Helvetica", fontsize="11")
    if overlay and overlay.title:
        g.graph_attr.update(label=overlay.title, labelloc="t", fontsize="14")
    g.node_attr.update(shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica", fontsize="12", color=_INK)
    g.edge_attr.update(fontname="Helvetica", fontsize="9", color=_INK, fontcolor=_INK, arrowsize="0.7")
    g.add_node("__start__", shape="point", width="0.15", label="", color=_INK, fillcolor=_INK)
    for s in _states(spec, overlay, lines):
        marked = overlay is not None and s in overlay.states
        note = overlay.states.get(s, "") if overlay else ""
        attrs_: dict[str, str] = {"label": f"{s}\n{note}" if note else s, "class": "state"}
        if s in TERMINALS:
            attrs_.update(peripheries="2", fillcolor="#e9ecef", **{"class": "state terminal"})
        elif s in spec.tool_states:
            attrs_.update(fillcolor="#e7f5ff", **{"class": "state tool"})
        elif s == ANY:
            attrs_.update(label="any state\n(fault edges)", style="rounded,dashed", color="#868e96", fontcolor="#868e96")
        if overlay is not None and not marked:
            attrs_.update(color=_DIM, fontcolor="#868e96")
        if marked:
            attrs_.update(color=_HOT, penwidth="2.5", fillcolor="#ffc078" if s in TERMINALS else "#ffe8cc")
            attrs_["class"] += " visited"
        g.add_node(s, **attrs_)
    g.add_edge("__start__", RESET, key="start", id="edge:start")
    for n, ln in enumerate(lines):
        e: dict[str, str] = {"label": ln.label, "id": _edge_id(ln.key, n), "class": "edge"}
        if ln.fault or ln.extra:
            e.update(style="dashed", color="#868e96", fontcolor="#868e96")
            e["class"] += " fault" if ln.fault else " extra"
        if overlay is not None and not ln.marked:
            e.update(color=_DIM, fontcolor=_DIM)
        if ln.marked:
            e.update(color=_HOT, fontcolor=_HOT_TEXT, penwidth="2.5", fontname="Helvetica-Bold")
            e["class"] += " visited"
        g.add_edge(ln.source, ln.dest, key=str(n), **e)
    return g


def machine_svg(spec: MachineSpec, overlay: Overlay | None = None, *, compact: bool = False) -> bytes:
    """The drawing rendered by Graphviz `dot` as SVG, with nothing run-dependent in it.

    Graphviz's version comment is replaced by a digest of the graph's source, which
    `stale_diagrams` compares: the layout itself may differ between Graphviz versions
    and installed fonts, the graph it lays out may not.
    """
    g = machine_dot(spec, overlay, compact=compact)
    digest = hashlib.sha256(g.string().encode()).hexdigest()
    g.layout("dot")
    svg = g.draw(format="svg").decode()
    svg = re.sub(r"<!-- Generated by graphviz.*?-->\n", "", svg, flags=re.S)
    svg = svg.replace("<svg ", f"<!-- drawn from engine/machine.py by engine/diagrams.py; graph sha256 {digest} -->\n<svg ", 1)
    return svg.encode()


def svg_digest(svg: bytes) -> str | None:
    """The graph digest an SVG of `machine_svg` carries (None for any other SVG)."""
    m = re.search(rb"graph sha256 ([0-9a-f]{64})", svg)
    return m.group(1).decode() if m else None


# -- the checked-in files ------------------------------------------------------------


def readme_text(spec: MachineSpec) -> str:
    """diagrams/README.md: the Mermaid (GitHub renders it), the compact view, a legend."""
    rows = [f"| `{s}` | {LEGEND.get(s, '')} |" for s in spec.states if s not in spec.tool_states]
    for state, name in spec.tool_states.items():
        rows.insert(4, f"| `{state}` | runs the turn's waiting calls to the `{name}` tool concurrently, then back to TOOL_CALL |")
    faults = ", ".join(f"`{t}`" for t in sorted(FAULT_TRIGGERS))
    parts = [
        "# The rollout machine",
        "",
        "Drawn from its definition (`engine/machine.py`, the built-in tools registered) by",
        "`python -m engine diagram`; do not edit. `python -m engine diagram --check` and",
        "`tests/test_diagrams.py` fail when these files fall behind the definition.",
        "",
        "`machine.mmd` is the Mermaid source below, `machine.svg` the same machine laid out by Graphviz.",
        "Each edge reads `trigger [guard]`; edges of one trigger from one state are tried in table order.",
        "",
        "| state | what it does |",
        "|---|---|",
        *rows,
        "",
        "## The whole machine",
        "",
        "```mermaid",
        machine_mermaid(spec).rstrip("\n"),
        "```",
        "",
        "## Without the fault edges",
        "",
        f"The same machine with the fault edges ({faults}) folded into one pseudo-state.",
        "",
        "```mermaid",
        machine_mermaid(spec, compact=True).rstrip("\n"),
        "```",
        "",
        "## One sample's path, a batch's flow",
        "",
        "`python -m engine trace samples.jsonl --sample 3 --out path.svg` prints the sample's timeline and",
        "draws this machine with its path highlighted; `python -m engine flow samples.jsonl --out flow.svg`",
        "counts every edge and ending over a whole file (also slime's `--save-debug-rollout-data` dumps).",
        "",
    ]
    return "\n".join(parts)


def render_diagrams(spec: MachineSpec | None = None) -> dict[str, bytes]:
    """The contents of every checked-in diagram file, by name."""
    spec = spec or builtin_spec()
    return {
        "machine.mmd": machine_mermaid(spec).encode(),
        "machine.svg": machine_svg(spec),
        "README.md": readme_text(spec).encode(),
    }


def write_diagrams(out_dir: str | Path, spec: MachineSpec | None = None) -> list[Path]:
    """Write machine.mmd, machine.svg and README.md into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in render_diagrams(spec).items():
        (out / name).write_bytes(data)
        written.append(out / name)
    return written


def stale_diagrams(out_dir: str | Path, spec: MachineSpec | None = None) -> list[str]:
    """The files of `out_dir` that are missing or differ from a fresh render ([] when current).

    The SVG is compared by the digest of the graph it draws (see `machine_svg`).
    """
    out = Path(out_dir)
    stale = []
    for name, fresh in render_diagrams(spec).items():
        path = out / name
        old = path.read_bytes() if path.is_file() else None
        same = old is not None and (svg_digest(old) == svg_digest(fresh) if name.endswith(".svg") else old == fresh)
        if not same:
            stale.append(str(path))
    return stale


def write_drawing(path: str | Path, spec: MachineSpec, overlay: Overlay | None = None) -> Path:
    """Write the (highlighted) machine to `path`: Mermaid for .mmd/.md, SVG for .svg."""
    path = Path(path)
    if path.suffix == ".svg":
        path.write_bytes(machine_svg(spec, overlay))
    elif path.suffix in (".mmd", ".mermaid", ".md"):
        text = machine_mermaid(spec, overlay)
        path.write_text(f"```mermaid\n{text}```\n" if path.suffix == ".md" else text, encoding="utf-8")
    else:
        raise ValueError(f"--out must end in .mmd or .svg, got {path.name}")
    return path


# -- commands --------------------------------------------------------------------------


def main_diagram(ns: argparse.Namespace) -> int:
    """`python -m engine diagram [--out DIR] [--check]`."""
    spec = builtin_spec()
    if ns.check:
        stale = stale_diagrams(ns.out, spec)
        if stale:
            print("stale diagrams (regenerate with `python -m engine diagram`): " + ", ".join(stale), file=sys.stderr)
            return 1
        print(f"{ns.out}: current")
        return 0
    for path in write_diagrams(ns.out, spec):
        print(f"wrote {path}")
    return 0


def main_trace(ns: argparse.Namespace) -> int:
    """`python -m engine trace FILE [--sample ID] [--out PATH]`."""
    try:
        samples = load_samples(ns.file)
        position, sample = select_sample(samples, str(ns.sample))
    except (OSError, ValueError) as exc:
        print(f"trace: {exc}", file=sys.stderr)
        return 2
    spec = spec_for_samples([sample])
    print(timeline(sample, spec, position=position))
    meta = sample.get("metadata") or {}
    title = f"sample #{position}: {str(sample.get('status', '')).rsplit('.', 1)[-1].upper()} ({meta.get('termination_reason')})"
    overlay = trace_overlay(spec, sample, title=title)
    return _emit(ns.out, spec, overlay)


def main_flow(ns: argparse.Namespace) -> int:
    """`python -m engine flow FILE [--out PATH]`."""
    try:
        samples = load_samples(ns.file)
    except (OSError, ValueError) as exc:
        print(f"flow: {exc}", file=sys.stderr)
        return 2
    spec = spec_for_samples(samples)
    print(flow_table(samples, spec))
    overlay = flow_overlay(spec, samples, title=f"{len(samples)} samples of {Path(ns.file).name}")
    return _emit(ns.out, spec, overlay)


def _emit(out: str | None, spec: MachineSpec, overlay: Overlay) -> int:
    if not out:
        print()
        print(machine_mermaid(spec, overlay), end="")
        return 0
    try:
        print(f"wrote {write_drawing(out, spec, overlay)}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def tool_states_of(names: Sequence[str]) -> list[str]:
    """The machine states of these tools (a convenience for callers and tests)."""
    return [tool_state(n) for n in names]
