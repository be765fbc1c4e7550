"""The paths recorded samples took through the machine: edges, counts, a timeline, a batch table.

Some triggers have several edges between the same two states (four `check` edges into
TRUNCATED, two `reply` edges into TOOL_CALL); the guard each sample recorded beside its
trace (`metadata["fsm"]["guards"]`) names the one taken. A step without a recorded guard
counts for every candidate, marked "?".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import attrs

from engine.machine.states import LOGS_A_TURN, TERMINALS, State, Trigger
from engine.machine.table import Edge, MachineSpec
from engine.trace.samples_file import final_state, fsm_trace, metadata, status_name

EdgeKey = tuple[str, str, str]  # (source, label, dest): how a drawing names an edge


def edge_key(edge: Edge) -> EdgeKey:
    """The drawing's name of a spec edge."""
    return (edge.source, edge.label, edge.dest)


@attrs.frozen
class Step:
    """One recorded edge and the spec edges it can be (one when resolved, none if unknown)."""

    number: int
    source: str
    trigger: str
    dest: str
    edges: tuple[Edge, ...]
    turn: dict[str, Any] | None = None  # the turn record of the reply this step belongs to

    @property
    def keys(self) -> list[EdgeKey]:
        """The drawing keys this step counts for; an edge the spec lacks keeps its trigger."""
        return [edge_key(e) for e in self.edges] or [(self.source, self.trigger, self.dest)]

    @property
    def certain(self) -> bool:
        return len(self.edges) == 1


@attrs.frozen
class Overlay:
    """What a drawing highlights: edges with a note (e.g. "×3"), states with an optional note."""

    edges: dict[EdgeKey, str] = attrs.field(factory=dict)
    states: dict[str, str] = attrs.field(factory=dict)
    title: str = ""


def _narrow(cands: list[Edge], guard: str) -> list[Edge]:
    """The edge among same-(source, trigger, dest) candidates whose guard the sample recorded."""
    if len(cands) <= 1 or not guard:
        return cands
    return [e for e in cands if e.guard is not None and e.guard.__name__ == guard] or cands


def resolve_path(spec: MachineSpec, sample: dict[str, Any]) -> list[Step]:
    """The sample's trace as steps, each matched to the spec edge(s) it can be."""
    meta = metadata(sample)
    turns = meta.get("turns") or []
    by_triple: dict[tuple[str, str, str], list[Edge]] = defaultdict(list)
    for e in spec.edges:
        by_triple[(e.source, e.trigger, e.dest)].append(e)
    trace = fsm_trace(sample)
    # Every reply edge logs one turn (and every compaction an entry), and a resumed sample's log
    # starts with the turns its checkpoint restored: the trace's replies are the log's last entries.
    current = len(turns) - sum(1 for item in trace if logs_a_turn(item[0], item[1])) - 1
    steps: list[Step] = []
    for n, item in enumerate(trace, 1):
        source, trigger, dest = item[:3]
        if logs_a_turn(source, trigger):
            current += 1
        turn = turns[current] if 0 <= current < len(turns) else None
        cands = _narrow(by_triple.get((source, trigger, dest), []), item[3])
        steps.append(Step(n, source, trigger, dest, tuple(cands), turn))
    return steps


def logs_a_turn(source: str, trigger: str) -> bool:
    """Whether an edge adds an entry to the turn log: a reply, or a compaction."""
    return (str(source), str(trigger)) in LOGS_A_TURN


def _note(certain: int, unsure: int) -> str:
    """An edge's note: "×3", or "×2+1?" when one more step may have been this edge or a sibling."""
    if not certain:
        return f"×{unsure}?"
    return f"×{certain}+{unsure}?" if unsure else f"×{certain}"


def trace_overlay(spec: MachineSpec, sample: dict[str, Any], title: str = "") -> Overlay:
    """One sample's path: each edge it took with "×n", each state it was in."""
    sure: Counter[EdgeKey] = Counter()
    unsure: Counter[EdgeKey] = Counter()
    states: dict[str, str] = {}
    for step in resolve_path(spec, sample):
        for key in step.keys:
            (sure if step.certain or not step.edges else unsure)[key] += 1
        states.setdefault(step.source, "")
        states.setdefault(step.dest, "")
    end = final_state(sample)
    if end in spec.states:  # a sample with no trace still ended somewhere (never PENDING: not a state)
        states.setdefault(end, "")
    keys = list(dict.fromkeys([*sure, *unsure]))
    return Overlay({k: _note(sure[k], unsure[k]) for k in keys}, states, title)


@attrs.frozen
class Tally:
    """A batch's edges: times taken, samples that took them, and those some step only may be."""

    times: Counter[EdgeKey]
    takers: Counter[EdgeKey]
    unsure: frozenset[EdgeKey]


def tally(samples: Sequence[dict[str, Any]], spec: MachineSpec | None = None) -> Tally:
    """Count every edge over the samples (an unresolved step counts for each candidate)."""
    spec = spec or spec_for_samples(samples)
    times: Counter[EdgeKey] = Counter()
    takers: Counter[EdgeKey] = Counter()
    unsure: set[EdgeKey] = set()
    for sample in samples:
        steps = resolve_path(spec, sample)
        times.update(key for step in steps for key in step.keys)
        takers.update({key for step in steps for key in step.keys})
        unsure.update(key for step in steps if len(step.edges) > 1 for key in step.keys)
    return Tally(times, takers, frozenset(unsure))


def terminal_counts(samples: Iterable[dict[str, Any]]) -> Counter[str]:
    """How many samples ended in each state."""
    return Counter(final_state(s) for s in samples)


def flow_overlay(spec: MachineSpec, samples: Sequence[dict[str, Any]], title: str = "") -> Overlay:
    """A batch: each edge with "n samples, ×times", each terminal with how many ended there, and
    ENVIRONMENT with the seconds the environments took."""
    t = tally(samples, spec)
    order = {edge_key(e): i for i, e in enumerate(spec.edges)}
    keys = sorted(t.times, key=lambda k: (order.get(k, len(order)), k))
    edges = {k: f"{_samples(t.takers[k])}, ×{t.times[k]}" + ("?" if k in t.unsure else "") for k in keys}
    states = {state: "" for key in keys for state in (key[0], key[2])}
    for state, n in terminal_counts(samples).items():
        # an agent's segment that a history break closed ends where the break led, not at a terminal
        states[state] = f"{_samples(n)} ended here" if state in TERMINALS else f"{_samples(n)} ended by a break here"
    seconds, turns = time_in_states(samples)[State.ENVIRONMENT.value]
    if turns or seconds:  # for user simulators and judges most of the wall time is here
        states[State.ENVIRONMENT.value] = f"{seconds:.3g} s, {turns} answers"
    return Overlay(edges, states, title)


def time_in_states(samples: Sequence[dict[str, Any]]) -> dict[str, tuple[float, int]]:
    """Seconds a batch spent where it waits, with the turns they were spent on (0: not per turn):
    GENERATE (the server), TOOL_CALL (the tools, all of them) and ENVIRONMENT (start, answers, end)."""
    metas = [metadata(s) for s in samples]

    def total(key: str) -> float:
        return sum(float(m[key]) for m in metas if isinstance(m.get(key), (int, float)))

    answered = sum(1 for m in metas for turn in m.get("turns") or []
                   if isinstance(turn, dict) and isinstance(turn.get("environment_seconds"), (int, float)))
    return {State.GENERATE.value: (total("generation_time"), sum(len(m.get("turns") or []) for m in metas)),
            State.TOOL_CALL.value: (total("tool_time"), 0),
            State.ENVIRONMENT.value: (total("environment_time"), answered)}


def _samples(n: int) -> str:
    return f"{n} sample" + ("" if n == 1 else "s")


def _step_details(step: Step, sample: dict[str, Any], last: bool) -> str:
    turn, meta = step.turn or {}, metadata(sample)
    parts: list[str] = []
    if step.source == State.GENERATE and step.trigger == Trigger.REPLY and turn:
        parts.append(f"turn {turn.get('turn')}: {turn.get('tokens')} tokens (max {turn.get('max_new_tokens')}), finish {turn.get('finish')}")
        if turn.get("problem"):
            parts.append(f"problem {turn['problem']}")
        if turn.get("weight_version") not in (None, "default"):
            parts.append(f"weights {turn['weight_version']}")
    elif step.trigger == "resume":
        replies = sum(1 for item in fsm_trace(sample) if item[0] == State.GENERATE and item[1] == Trigger.REPLY)
        restored = len(meta.get("turns") or []) - replies
        parts.append(f"{restored} turns restored from the checkpoint" if step.dest == "RESUME" else "checkpoint rejected: restart from the prompt")
    elif step.trigger == "dispatch":
        parts.append(f"calls to {step.dest.removeprefix('TOOL_').lower()}")
    elif step.trigger == "observe" and turn:
        names = turn.get("tools") or []
        parts.append(f"observation {turn.get('observation_tokens')} tokens from {', '.join(names) or 'no call (a note)'}")
    elif step.trigger == Trigger.HARNESS_CALL:
        guard = step.edges[0].guard_name if step.certain else None
        if guard in ("history_extends", "observation_over_budget"):
            parts.append(f"the harness's next call added {turn.get('observation_tokens')} tokens")
        else:
            parts.append(f"segment break: {guard or 'a break'}; the next segment's prompt is the history as the harness gave it")
    elif step.trigger == Trigger.COMPACTED and turn:
        kept = f", {turn.get('dropped')} turns left out"
        if turn.get("compaction") == "summarize":
            parts.append(f"summary of {turn.get('summary_tokens', 0)} tokens ({turn.get('tokens')} trained){kept}")
        else:
            parts.append(f"the oldest exchanges dropped{kept}")
    elif step.trigger == Trigger.HARNESS_END:
        parts.append("the harness ended its session")
    elif step.source == State.ENVIRONMENT and step.trigger == Trigger.ENV_REPLY and turn:
        parts.append(f"the environment answered in {float(turn.get('environment_seconds') or 0):.3f} s")
        if turn.get("user_tokens"):
            parts.append(f"user turn {turn['user_tokens']} tokens")
        if turn.get("environment_blocked_seconds"):
            parts.append(f"held the event loop {turn['environment_blocked_seconds']:.2f} s")
    elif step.trigger == "trim" and turn:
        parts.append(f"trimmed {turn.get('trimmed_tokens')} tokens")
    if step.trigger in ("crashed", "cancelled", "request_failed", "request_rejected", "context_rejected") and meta.get("engine_error"):
        parts.append(f"error {_short(meta['engine_error'])}")
    if step.trigger == "invariant_violated" and meta.get("invariant_violation"):
        parts.append(f"violation {_short(meta['invariant_violation'])}")
    if not step.edges:
        parts.append("not an edge of this machine")
    if last and step.dest in TERMINALS:
        parts.append(f"reason {meta.get('termination_reason')}")
    return "; ".join(parts)


def _short(text: Any, limit: int = 90) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _step_label(step: Step) -> str:
    if len(step.edges) == 1:
        return step.edges[0].label
    guards = [e.guard.__name__ for e in step.edges if e.guard is not None]
    return f"{step.trigger} [{' | '.join(guards)}?]" if guards else step.trigger


def timeline(sample: dict[str, Any], spec: MachineSpec | None = None, position: int | None = None) -> str:
    """A text report of one sample: status, reason, totals, then one row per edge taken."""
    spec = spec or spec_for_samples([sample])
    meta = metadata(sample)
    stats = meta.get("tool_stats") or {}
    name = f"sample index {sample['index']}" if sample.get("index") is not None else "sample"
    if position is not None:
        name += f" (position {position} in the file)"
    segment = meta.get("segment")
    segmented = isinstance(segment, dict) and segment.get("count", 1) > 1
    head = [
        f"{name}: status {status_name(sample)}, termination reason {meta.get('termination_reason')}",
        # a segment's turns are its own; the counts and times are its whole rollout's
        f"turns {len(meta.get('turns') or [])}, {'the rollout: ' if segmented else ''}tool calls {stats.get('calls', 0)}, "
        f"tool errors {stats.get('errors') or 'none'}, "
        f"generation {float(meta.get('generation_time') or 0):.3f} s, tools {float(meta.get('tool_time') or 0):.3f} s"
        + (f", environment {float(meta.get('environment_time') or 0):.3f} s" if meta.get("environment") else ""),
    ]
    if segmented:
        ended = f", ended by {segment['ended_by']}" if segment.get("ended_by") else ""
        head.append(f"segment {segment.get('index', 0) + 1} of {segment['count']} of a rollout{ended} "
                    f"(breaks: {', '.join(meta.get('breaks') or []) or 'none'})")
    if meta.get("engine_error"):
        head.append(f"engine error: {_short(meta['engine_error'], 200)}")
    steps = resolve_path(spec, sample)
    if not steps:
        return "\n".join([*head, "no edges recorded"])
    rows = [(str(s.number), f"{s.source} -> {s.dest}", _step_label(s), _step_details(s, sample, s is steps[-1])) for s in steps]
    rows.insert(0, ("step", "edge", "trigger [guard]", "details"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows]
    return "\n".join([*head, "", *lines])


def flow_table(samples: Sequence[dict[str, Any]], spec: MachineSpec | None = None) -> str:
    """A batch in text: per edge samples and times (machine order), per terminal and per reason."""
    spec = spec or spec_for_samples(samples)
    t = tally(samples, spec)
    times, takers = t.times, t.takers
    order = [edge_key(e) for e in spec.edges]
    keys = [k for k in order if k in times] + sorted(k for k in times if k not in order)
    rows = [("edge", "trigger [guard]", "samples", "times")]
    rows += [(f"{k[0]} -> {k[2]}", k[1], str(takers[k]), f"{times[k]}?" if k in t.unsure else str(times[k])) for k in keys]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{len(samples)} samples", ""]
    lines += [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}" for r in rows]
    lines.append(f"({sum(1 for k in order if k not in times)} of {len(order)} edges of the machine not taken)")
    if t.unsure:
        lines.append("(?: some steps could be this edge or another of the same trigger; counted for each)")
    ends = Counter(_end_name(s) for s in samples)
    reasons = Counter((_end_name(s), str(metadata(s).get("termination_reason"))) for s in samples)
    w0 = max([len("terminal"), *(len(s) for s in ends)])
    lines += ["", f"{'terminal':<{w0}}  samples"]
    lines += [f"{s:<{w0}}  {ends[s]:>7}" for s in sorted(ends, key=lambda s: (_rank(spec, s.split()[0]), s))]
    w1 = max([len("termination reason"), *(len(r) for _, r in reasons)])
    lines += ["", f"{'termination reason':<{w1}}  {'terminal':<{w0}}  samples"]
    for (state, reason), n in sorted(reasons.items(), key=lambda kv: (_rank(spec, kv[0][0].split()[0]), -kv[1], kv[0][1])):
        lines.append(f"{reason:<{w1}}  {state:<{w0}}  {n:>7}")
    times = time_in_states(samples)
    if any(seconds for seconds, _ in times.values()):
        w2 = max(len("time in"), *(len(state) for state in times))
        lines += ["", f"{'time in':<{w2}}  {'seconds':>9}  {'turns':>6}  {'per turn':>9}"]
        for state, (seconds, turns) in times.items():
            per = f"{seconds / turns:>9.3g}" if turns else ""
            lines.append(f"{state:<{w2}}  {seconds:>9.3g}  {turns or '':>6}  {per}".rstrip())
    from engine.trace.summary import foreign_answers  # summary imports the turn reader; only needed here

    foreign = foreign_answers([metadata(s) for s in samples])
    if foreign:
        lines += ["", "answers that look like calls of another format:"]
        lines += [f"  {name}  {n}" for name, n in foreign.most_common()]
    return "\n".join(lines)


def _end_name(sample: dict[str, Any]) -> str:
    """Where a sample ended, for the text: an agent's segment that a history break closed ends
    where the break led (BUDGET_CHECK), not at a terminal, and says so."""
    state = final_state(sample)
    segment = metadata(sample).get("segment")
    if state not in TERMINALS and isinstance(segment, dict) and segment.get("ended_by"):
        return f"{state} (a break)"
    return state


def _rank(spec: MachineSpec, state: str) -> int:
    return spec.states.index(state) if state in spec.states else len(spec.states)


# -- which machine ---------------------------------------------------------------------


@cache
def builtin_tool_names(modules: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The tools a fresh `import engine.tools` registers (plus those of `modules`): what `diagram` draws.

    Asked of a fresh interpreter so that tools a test (or a caller) registered in this
    process never leak into the checked-in diagrams or their staleness check. Raises
    ValueError naming a module that cannot be imported.
    """
    root = str(Path(__file__).resolve().parents[2])
    path = [root, os.getcwd(), os.environ.get("PYTHONPATH")]  # a user's module lives beside them
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    code = ("import importlib, json, sys\nfrom engine import tools\n"
            "for m in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as exc:\n"
            "        print(json.dumps({'module': m, 'error': f'{type(exc).__name__}: {exc}'}))\n"
            "        sys.exit(3)\n"
            "print(json.dumps(list(tools.names())))")
    done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env, cwd=root,
                          timeout=120)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == 3:
        failed = json.loads(last)
        raise ValueError(f"--tool-module {failed['module']}: cannot import it ({failed['error']})")
    if done.returncode != 0:
        raise RuntimeError(f"importing the tools package failed:\n{done.stderr}")
    return tuple(json.loads(last))


def builtin_spec(modules: tuple[str, ...] = ()) -> MachineSpec:
    """The machine with the built-in tools registered (and those of `modules`)."""
    return MachineSpec.from_registry(tool_names=builtin_tool_names(tuple(modules)))


def spec_for_samples(samples: Sequence[dict[str, Any]]) -> MachineSpec:
    """The built-in machine plus a state for every other tool the samples' traces passed through."""
    names = set(builtin_tool_names())
    for sample in samples:
        for step in fsm_trace(sample):
            names.update(s.removeprefix("TOOL_").lower() for s in step[:3:2] if s.startswith("TOOL_") and s != "TOOL_CALL")
    return MachineSpec.from_registry(tool_names=tuple(sorted(names)))
