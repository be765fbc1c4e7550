"""Rendering the machine: one list of nodes and lines from a `MachineSpec`, as Mermaid or as SVG.

The drawing is built straight from `MachineSpec` rather than through `transitions`'
GraphMachine: the spec already holds every state and edge with its guard name, a
GraphMachine would label guards by the wrapped callables (lambdas here), needs a model
attached, and can highlight only the current state and last edge, not a whole path with
counts. Mermaid and Graphviz both draw the same lines, in spec order, so the output is
the same every run. An `Overlay` (engine/trace/paths.py) highlights what samples took.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import attrs

from engine.machine.states import TERMINALS, State
from engine.machine.table import FAULT_TRIGGERS, MachineSpec
from engine.trace.paths import EdgeKey, Overlay, edge_key

ANY = "ANY"  # the pseudo-state the compact drawing folds the fault edges into


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
    if set(rest) == TERMINALS and len(states) > 3:
        return "every non-terminal state"
    if len(states) <= max(3, len(rest)):  # whichever list is shorter
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
    out += ["stateDiagram-v2", "    %% drawn from engine/machine/table.py by engine/trace/drawing.py: do not edit by hand"]
    out += [f"    classDef {name} {style}" for name, style in _MERMAID_CLASSES.items()]
    if ANY in states:
        out.append('    state "any state (fault edges)" as ANY')
    out.append(f"    [*] --> {State.RESET}")
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


def svg_edge_id(key: EdgeKey | None, n: int = 0) -> str:
    """The SVG id of an edge: "edge:SOURCE:trigger_guard:DEST" (XML-safe); folds are "fold<n>"."""
    if key is None:
        return f"fold{n}"
    return "edge:" + ":".join(re.sub(r"[^A-Za-z0-9_]+", "_", part).strip("_") for part in key)


_Items = tuple[dict[str, str], list[tuple[str, dict[str, str]]], list[tuple[str, str, dict[str, str]]]]


def _dot_items(spec: MachineSpec, overlay: Overlay | None, compact: bool) -> _Items:
    """Graph attributes, nodes and edges with their Graphviz attributes, in drawing order."""
    lines = _lines(spec, overlay, compact)
    graph = {"rankdir": "LR", "nodesep": "0.35", "ranksep": "0.5", "fontname": "Helvetica", "fontsize": "11"}
    if overlay and overlay.title:
        graph.update(label=overlay.title, labelloc="t", fontsize="14")
    nodes: list[tuple[str, dict[str, str]]] = [("__start__", {"shape": "point", "width": "0.15", "label": "", "fillcolor": _INK})]
    for s in _states(spec, overlay, lines):
        marked = overlay is not None and s in overlay.states
        note = overlay.states.get(s, "") if overlay else ""
        a: dict[str, str] = {"label": f"{s}\n{note}" if note else s, "class": "state", "id": f"state:{s}"}
        if s in TERMINALS:
            a.update({"peripheries": "2", "fillcolor": "#e9ecef", "class": "state terminal"})
        elif s in spec.tool_states:
            a.update({"fillcolor": "#e7f5ff", "class": "state tool"})
        elif s == ANY:
            a.update(label="any state\n(fault edges)", style="rounded,dashed", color="#868e96", fontcolor="#868e96")
        if overlay is not None and not marked:
            a.update(color=_DIM, fontcolor="#868e96")
        if marked:
            a.update(color=_HOT, penwidth="2.5", fillcolor="#ffc078" if s in TERMINALS else "#ffe8cc")
            a["class"] += " visited"
        nodes.append((s, a))
    edges: list[tuple[str, str, dict[str, str]]] = [("__start__", str(State.RESET), {"id": "edge:start"})]
    for n, ln in enumerate(lines):
        classes = []  # Graphviz itself adds "edge"
        e: dict[str, str] = {"label": ln.label, "id": svg_edge_id(ln.key, n)}
        if ln.fault or ln.extra:
            # constraint=false: edges from every state would otherwise pull the ranks apart
            e.update(style="dashed", color="#868e96", fontcolor="#868e96", constraint="false")
            classes.append("fault" if ln.fault else "extra")
        if overlay is not None and not ln.marked:
            e.update(color=_DIM, fontcolor=_DIM)
        if ln.marked:
            e.update(color=_HOT, fontcolor=_HOT_TEXT, penwidth="2.5", fontname="Helvetica-Bold")
            classes.append("visited")
        if classes:
            e["class"] = " ".join(classes)
        edges.append((ln.source, ln.dest, e))
    return graph, nodes, edges


DIAGRAMS_EXTRA = "pip install pygraphviz (or, in the engine's checkout, pip install -e '.[diagrams]')"


class SvgUnavailable(ImportError):
    """pygraphviz (the `diagrams` extra) is not installed: no SVG, the Mermaid still works."""


def machine_dot(spec: MachineSpec, overlay: Overlay | None = None, *, compact: bool = False) -> Any:
    """The drawing as a `pygraphviz.AGraph` (not laid out); SvgUnavailable without pygraphviz."""
    try:
        import pygraphviz  # lazily: the Graphviz libraries load only when an SVG is drawn
    except ImportError:
        raise SvgUnavailable(f"SVG drawings need pygraphviz, which is not installed: {DIAGRAMS_EXTRA}") from None

    graph, nodes, edges = _dot_items(spec, overlay, compact)
    g = pygraphviz.AGraph(directed=True, strict=False, name="machine")
    g.graph_attr.update(graph)
    g.node_attr.update(shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica", fontsize="12", color=_INK)
    g.edge_attr.update(fontname="Helvetica", fontsize="9", color=_INK, fontcolor=_INK, arrowsize="0.7")
    for name, a in nodes:
        g.add_node(name, **a)
    for n, (source, dest, a) in enumerate(edges):
        g.add_edge(source, dest, key=str(n), **a)  # keys keep parallel edges apart
    return g


def machine_svg(spec: MachineSpec, overlay: Overlay | None = None, *, compact: bool = False) -> bytes:
    """The drawing rendered by Graphviz `dot` as SVG, with nothing run-dependent in it.

    Graphviz's version comment is replaced by a digest of what was drawn (states, edges,
    their attributes), which `stale_diagrams` compares: the layout may differ between
    Graphviz builds and installed fonts (Pango measures the labels), the drawing may not.
    """
    digest = drawing_digest(spec, overlay, compact=compact)
    g = machine_dot(spec, overlay, compact=compact)
    g.layout("dot")
    svg = g.draw(format="svg").decode()
    svg = re.sub(r"<!-- Generated by graphviz.*?-->\n", "", svg, flags=re.S)
    svg = svg.replace("<svg ", f"<!-- drawn from engine/machine/table.py by engine/trace/drawing.py; drawing sha256 {digest} -->\n<svg ", 1)
    return svg.encode()


def drawing_digest(spec: MachineSpec, overlay: Overlay | None = None, *, compact: bool = False) -> str:
    """The digest of what an SVG of this drawing shows (no Graphviz needed to compute it)."""
    items = _dot_items(spec, overlay, compact)
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def svg_digest(svg: bytes) -> str | None:
    """The graph digest an SVG of `machine_svg` carries (None for any other SVG)."""
    m = re.search(rb"drawing sha256 ([0-9a-f]{64})", svg)
    return m.group(1).decode() if m else None

