"""slime's own agent adapter and the engine's sessions, side by side on the same sessions, on CPU
against the embedded server (tests/support/side_by_side.py; the numbers are in docs/agents.md).

slime is not installable: set SLIME_CHECKOUT to a checkout of THUDM/slime (the directory holding
its `slime` package). The comparison runs in a subprocess with the checkout on its PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = os.environ.get("SLIME_CHECKOUT", "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHECKOUT and (Path(CHECKOUT) / "slime" / "agent" / "adapters").is_dir()),
                       reason="no slime checkout: set SLIME_CHECKOUT to a checkout of THUDM/slime (holding slime/agent/adapters)"),
]


def test_the_same_sessions_through_slime_s_adapter_and_the_engine() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), CHECKOUT])}
    done = subprocess.run([sys.executable, "-m", "tests.support.side_by_side"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    slime, engine = found["slime"], found["engine"]
    sessions = len(found["prompts"])
    for variant in ("verbatim", "reasoning_dropped", "compacted"):
        assert len(slime[variant]) == len(engine[variant]) == sessions
        assert all(row["samples"] >= 1 for row in slime[variant]), "slime's adapter made no sample of a session"
    # the engine: one sample per session for a harness that sends its history back, with or without
    # the reasoning; a compacted history is a named break, one sample more
    assert [row["samples"] for row in engine["verbatim"]] == [1] * sessions
    assert engine["reasoning_dropped"] == engine["verbatim"]
    assert [row["breaks"] for row in engine["compacted"]] == [["history_compacted"], ["history_compacted"], []]
    # every token the model sampled is trained: as many as slime trains, or more
    for variant in slime:
        for ours, theirs in zip(engine[variant], slime[variant]):
            assert ours["trained"] >= theirs["trained"], (variant, ours, theirs)
