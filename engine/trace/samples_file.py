"""Reading recorded samples back: this project's rollout JSONL, or slime's debug rollout dump.

Both hold slime `Sample`s as plain dicts. slime's `--save-debug-rollout-data` writes
`torch.save({"rollout_id": id, "samples": [sample.to_dict(), ...]})`
(slime/observability/rollout_data_utils.py), where `to_dict` stores `status` as the
enum's value ("completed"). The trace tools read only `index`, `status` and what the engine
recorded in `metadata["fsm"]` (dumps written before that namespace keep it flat in `metadata`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
# torch.save writes a zip archive since torch 1.6, a bare pickle before.
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


class NotSamples(ValueError):
    """The file is not a rollout JSONL (its message names the line) nor a slime dump."""


def load_samples(path: str | Path, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every sample of a rollout JSONL or a `torch.save` dump, as dicts, in file order.

    A JSONL whose last line is cut off (its writer was stopped mid-line) is read without that
    line, with one sentence to `warn` (default: the log) naming it; any other line that is not
    JSON raises `NotSamples` naming it.
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith(_TORCH_MAGIC):
        return _from_torch(path)
    return _from_json(path, warn or log.warning)


def _from_torch(path: Path) -> list[dict[str, Any]]:
    import torch  # lazily: the JSONL path and `diagram` never need it

    data = torch.load(path, weights_only=False)  # slime's dumps hold plain Python objects
    items = data.get("samples", []) if isinstance(data, dict) else data
    samples = [_as_dict(item) for item in _flatten(items)]
    for sample in samples:  # as the JSONL path reads it: the engine writes tuples, JSON gives lists back
        if isinstance(sample.get("metadata"), dict):
            sample["metadata"] = _as_json(sample["metadata"])
    return samples


def _as_json(value: Any) -> Any:
    """Tuples as lists, all the way down (what a JSON round trip does to them)."""
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    return value


def _json_rows(path: Path, text: str, warn: Callable[[str], None]) -> list[Any]:
    lines = text.splitlines()
    rows: list[Any] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
            continue
        except json.JSONDecodeError as exc:
            bad = f"line {n} is not JSON ({exc.msg}, column {exc.colno})"
        if not rows:  # one pretty-printed JSON document instead of JSONL?
            try:
                return [json.loads(text)]
            except json.JSONDecodeError:
                raise NotSamples(bad) from None
        if any(rest.strip() for rest in lines[n:]):
            raise NotSamples(bad)
        warn(f"{path}: line {n}, the last, is cut off (its writer was stopped mid-line): "
             f"skipped; read the {len(rows)} line(s) before it")
    return rows


def _from_json(path: Path, warn: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = _json_rows(path, path.read_text(encoding="utf-8"), warn)
    out: list[dict[str, Any]] = []
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get("samples"), list) and "metadata" not in row:
            out.extend(_as_dict(s) for s in _flatten(row["samples"]))
        else:
            out.extend(_as_dict(s) for s in _flatten([row]))
    return out


def _flatten(items: Any) -> list[Any]:
    """Groups of samples (lists of lists, as slime's rollouts return them) become one list."""
    flat: list[Any] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            flat.extend(_flatten(item))
        else:
            flat.append(item)
    return flat


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, dict):
        return item
    if hasattr(item, "to_dict"):  # a slime Sample object
        return dict(item.to_dict())
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
    if hasattr(item, "__dict__"):
        return dict(vars(item))
    raise ValueError(f"not a sample: {type(item).__name__}")


def select_sample(samples: Sequence[dict[str, Any]], *, index: int | None = None,
                  position: int | None = None) -> tuple[int, dict[str, Any]]:
    """The sample whose `index` field is `index`, or the one at `position` (0 first, -1 last), and its position.

    With neither, the first sample. Raises ValueError naming what the file holds.
    """
    if not samples:
        raise ValueError("the file holds no samples")
    if index is not None:
        for pos, sample in enumerate(samples):
            if sample.get("index") == index:
                return pos, sample
        known = sorted(i for i in (s.get("index") for s in samples) if isinstance(i, int))
        held = f"indexes {known[0]} to {known[-1]}" if known else "no index fields"
        raise ValueError(f"--sample {index}: no sample has index {index} (the file holds {len(samples)} samples, "
                         f"{held}; --position N picks by place in the file)")
    pos = 0 if position is None else position
    if not -len(samples) <= pos < len(samples):
        raise ValueError(f"--position {pos}: the file holds {len(samples)} samples (0 to {len(samples) - 1}, or -1 for the last)")
    pos %= len(samples)
    return pos, samples[pos]


def has_traces(samples: Sequence[dict[str, Any]]) -> bool:
    """Whether any sample carries the path the engine recorded (a prompts file does not)."""
    return any(fsm_trace(s) for s in samples)


def metadata(sample: dict[str, Any]) -> dict[str, Any]:
    """What the engine recorded on the sample: `metadata["fsm"]` ({} when missing)."""
    meta = sample.get("metadata")
    if not isinstance(meta, dict):
        return {}
    fsm = meta.get("fsm")
    if isinstance(fsm, dict):
        return fsm
    if "fsm_trace" in meta:  # an older dump: the same keys, flat, the path under fsm_ names
        return {**meta, "trace": meta.get("fsm_trace"), "guards": meta.get("fsm_guards")}
    return {}


def fsm_trace(sample: dict[str, Any]) -> list[tuple[str, ...]]:
    """The recorded path: (source, trigger, dest, guard) per edge taken ("" for no guard)."""
    meta = metadata(sample)
    steps = meta.get("trace") or []
    guards = list(meta.get("guards") or [])
    guards += [""] * (len(steps) - len(guards))
    return [(*(str(x) for x in step[:3]), str(guard or "")) for step, guard in zip(steps, guards)]


def status_name(sample: dict[str, Any]) -> str:
    """The status as a state name: "completed", "Status.COMPLETED" or the enum give "COMPLETED"."""
    status = sample.get("status")
    if isinstance(status, Enum):
        status = status.value
    text = str(status or "pending")
    return text.rsplit(".", 1)[-1].upper()


def final_state(sample: dict[str, Any]) -> str:
    """Where the sample ended: the last edge's dest, or its status when it has no trace."""
    trace = fsm_trace(sample)
    return trace[-1][2] if trace else status_name(sample)
