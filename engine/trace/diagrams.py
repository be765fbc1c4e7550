"""The machine's diagrams: the checked-in `diagrams/`, and the `diagram`, `trace`, `flow` commands.

`python -m engine diagram` draws the machine with the built-in tools registered (see
engine/trace/drawing.py for how); `trace` and `flow` draw it with an `Overlay` highlighting
the edges and states recorded samples took (engine/trace/paths.py), read from a rollout
JSONL or a slime debug dump (engine/trace/samples_file.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from engine.machine.table import MachineSpec
from engine.trace.drawing import (
    FAULT_TRIGGERS,
    SvgUnavailable,
    drawing_digest,
    machine_dot,
    machine_mermaid,
    machine_svg,
    svg_digest,
    svg_edge_id,
)
from engine.trace.paths import Overlay, builtin_spec, flow_overlay, flow_table, spec_for_samples, timeline, trace_overlay
from engine.trace.samples_file import NotSamples, has_traces, load_samples, metadata, select_sample, status_name

__all__ = [
    "Overlay",
    "builtin_spec",
    "load_samples",
    "machine_dot",
    "machine_mermaid",
    "machine_svg",
    "main_diagram",
    "main_flow",
    "main_trace",
    "readme_text",
    "spec_for_samples",
    "stale_diagrams",
    "svg_edge_id",
    "timeline",
    "write_diagrams",
    "write_drawing",
]

# -- which machine -------------------------------------------------------------------


# -- the checked-in files ------------------------------------------------------------


def readme_text(spec: MachineSpec) -> str:
    """diagrams/README.md: the Mermaid (GitHub renders it), the compact view, a legend."""
    rows = [f"| `{s}` | {'terminal: ' if d.kind == 'terminal' else ''}{d.legend} |" for s, d in spec.defs.items()]
    faults = ", ".join(f"`{t}`" for t in sorted(FAULT_TRIGGERS))
    parts = [
        "# The rollout machine",
        "",
        "Drawn from its definition (`engine/machine/states.py` and `table.py`, the built-in tools registered) by",
        "`python -m engine diagram`; do not edit. `python -m engine diagram --check` and",
        "`tests/trace/test_diagrams.py` fail when these files fall behind the definition.",
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


def render_diagrams(spec: MachineSpec | None = None, *, svg: bool = True) -> dict[str, bytes]:
    """The contents of every checked-in diagram file, by name (the SVG only with `svg`:
    it needs pygraphviz, SvgUnavailable without it)."""
    spec = spec or builtin_spec()
    files = {"machine.mmd": machine_mermaid(spec).encode(), "README.md": readme_text(spec).encode()}
    if svg:
        files["machine.svg"] = machine_svg(spec)
    return files


README_START = "<!-- machine diagram: written by `python -m engine diagram`, do not edit -->"
README_END = "<!-- end of machine diagram -->"
PROJECT_DIAGRAMS = "diagrams"  # the folder whose drawing the README beside it embeds


def _project_readme(out_dir: Path, spec: MachineSpec) -> tuple[Path, str, str] | None:
    """The project README beside `out_dir` with its embedded diagram: (path, current, fresh).

    None when `out_dir` is not a `diagrams/` folder (a user's `--out my-diagrams`, perhaps with
    their own tools drawn in, leaves the checkout's README alone), or when there is no README
    beside it or it has no diagram markers.
    """
    if out_dir.resolve().name != PROJECT_DIAGRAMS:
        return None
    path = out_dir.resolve().parent / "README.md"
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if README_START not in text or README_END not in text:
        return None
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    block = f"{README_START}\n```mermaid\n{machine_mermaid(spec, compact=True)}```\n{README_END}"
    return path, text, head + block + tail


def write_diagrams(out_dir: str | Path, spec: MachineSpec | None = None, *,
                   skipped: list[str] | None = None) -> list[Path]:
    """Write machine.mmd, machine.svg and README.md into `out_dir`; return their paths.

    Into a `diagrams/` folder, the compact drawing embedded in the README beside it (between
    its markers) is rewritten too, so the project's README never shows an old machine. Without pygraphviz the SVG
    is left out and its reason appended to `skipped` (SvgUnavailable when none is given).
    """
    spec = spec or builtin_spec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    files = render_diagrams(spec, svg=False)
    try:
        files["machine.svg"] = machine_svg(spec)
    except SvgUnavailable as exc:
        if skipped is None:
            raise
        skipped.append(f"{out / 'machine.svg'} not drawn: {exc}")
    for name, data in files.items():
        (out / name).write_bytes(data)
        written.append(out / name)
    readme = _project_readme(out, spec)
    if readme is not None and readme[1] != readme[2]:
        readme[0].write_text(readme[2], encoding="utf-8")
        written.append(readme[0])
    return written


def stale_diagrams(out_dir: str | Path, spec: MachineSpec | None = None) -> list[str]:
    """The files of `out_dir` that are missing or differ from a fresh render ([] when current).

    The SVG is compared by the digest of the graph it draws (see `machine_svg`).
    """
    spec = spec or builtin_spec()
    out = Path(out_dir)
    stale = []
    readme = _project_readme(out, spec)
    if readme is not None and readme[1] != readme[2]:
        stale.append(str(readme[0]))
    for name, fresh in render_diagrams(spec, svg=False).items():
        path = out / name
        old = path.read_bytes() if path.is_file() else None
        if old != fresh:
            stale.append(str(path))
    svg = out / "machine.svg"  # compared by digest: no Graphviz needed
    if not svg.is_file() or svg_digest(svg.read_bytes()) != drawing_digest(spec):
        stale.append(str(svg))
    return stale


OUT_SUFFIXES = (".svg", ".mmd", ".mermaid", ".md")


def write_drawing(path: str | Path, spec: MachineSpec, overlay: Overlay | None = None) -> Path:
    """Write the (highlighted) machine to `path`: SVG for .svg, Mermaid for .mmd (a fenced block for .md)."""
    path = Path(path)
    if path.suffix not in OUT_SUFFIXES:
        raise ValueError(f"--out must end in .mmd or .svg, got {path.name}")
    if path.suffix == ".svg":
        path.write_bytes(machine_svg(spec, overlay))  # SvgUnavailable without pygraphviz: nothing written
    else:
        text = machine_mermaid(spec, overlay)
        path.write_text(f"```mermaid\n{text}```\n" if path.suffix == ".md" else text, encoding="utf-8")
    return path


# -- commands --------------------------------------------------------------------------


def main_diagram(ns: argparse.Namespace) -> int:
    """`python -m engine diagram [--out DIR] [--check] [--tool-module M ...]`."""
    try:
        spec = builtin_spec(tuple(getattr(ns, "tool_modules", None) or ()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ns.check:
        stale = stale_diagrams(ns.out, spec)
        if stale:
            print("stale diagrams (regenerate with `python -m engine diagram`): " + ", ".join(stale), file=sys.stderr)
            return 1
        print(f"{ns.out}: current")
        return 0
    skipped: list[str] = []
    try:
        written = write_diagrams(ns.out, spec, skipped=skipped)
    except OSError as exc:
        print(f"error: --out {ns.out}: cannot write there ({exc.strerror or exc})", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    for note in skipped:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _load_traced(path: str) -> list[dict[str, Any]]:
    """The samples of a file the engine wrote; refuses a file with no recorded path (a prompts file)."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory; give a rollout JSONL or a slime dump")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    try:
        samples = load_samples(path, warn=lambda note: print(f"warning: {note}", file=sys.stderr))
    except NotSamples as exc:
        raise ValueError(f"{path}: not a rollout JSONL or a slime dump ({exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a rollout JSONL or a slime dump ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # torch.load / unpickling of a foreign file: one sentence, no traceback
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from None
    if not samples:
        raise ValueError(f"{path}: holds no samples")
    if not has_traces(samples):
        raise ValueError(f"{path}: holds no engine traces (metadata['fsm']['trace']); is it a prompts file? "
                         "Roll it out first: python -m engine run --input FILE")
    return samples


def main_trace(ns: argparse.Namespace) -> int:
    """`python -m engine trace FILE [--sample INDEX | --position N] [--text] [--out PATH]`."""
    try:
        _check_out(ns.out)
        samples = _load_traced(ns.file)
        position, sample = select_sample(samples, index=getattr(ns, "sample", None), position=getattr(ns, "position", None))
        decode = _decoder(getattr(ns, "tokenizer", None)) if getattr(ns, "text", False) else None
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = spec_for_samples([sample])
    print(timeline(sample, spec, position=position))
    if decode is not None:
        from engine.trace.turns import format_turns

        print()
        print(format_turns(sample, decode))
    name = f"index {sample['index']}" if sample.get("index") is not None else f"position {position}"
    title = f"sample {name}, {status_name(sample)} ({metadata(sample).get('termination_reason')})"
    overlay = trace_overlay(spec, sample, title=title)
    return _emit(ns.out, spec, overlay)


def _decoder(path: str | None) -> Any:
    """Token ids -> text with the tokenizer at `path` (default: the shipped Qwen3 one)."""
    if path is not None and not os.path.isdir(path):
        raise ValueError(f"--tokenizer {path}: not a directory holding tokenizer files")
    from engine.profiles.tokenizer import Codec, load_tokenizer

    try:
        return Codec(load_tokenizer(path)).decode
    except Exception as exc:  # transformers raises many kinds
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer there ({type(exc).__name__})") from None


def main_flow(ns: argparse.Namespace) -> int:
    """`python -m engine flow FILE [--out PATH]`."""
    try:
        _check_out(ns.out)
        samples = _load_traced(ns.file)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = spec_for_samples(samples)
    print(flow_table(samples, spec))
    overlay = flow_overlay(spec, samples, title=f"{len(samples)} samples of {Path(ns.file).name}")
    return _emit(ns.out, spec, overlay)


def _check_out(out: str | None) -> None:
    """Refuse an --out we cannot write before any work is done."""
    if not out:
        return
    if Path(out).suffix not in OUT_SUFFIXES:
        raise ValueError(f"--out must end in .mmd or .svg, got {Path(out).name}")
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: the directory {parent} does not exist")


def _emit(out: str | None, spec: MachineSpec, overlay: Overlay) -> int:
    if out:
        try:
            print(f"wrote {write_drawing(out, spec, overlay)}")
        except SvgUnavailable as exc:  # the Mermaid needs nothing: write it beside, and say why
            mermaid = Path(out).with_suffix(".mmd")
            print(f"wrote {write_drawing(mermaid, spec, overlay)}")
            print(f"note: {out} not drawn: {exc}", file=sys.stderr)
    else:  # the mermaid follows the printed report
        print()
        print(machine_mermaid(spec, overlay), end="")
    return 0
