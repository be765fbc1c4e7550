"""Cooperative abort cuts tool calls that are running when slime starts aborting the step.

slime's `abort()` waits for every pending sample; a sample whose sandboxed program runs for
minutes would hold the step that long. With the real sandbox: the run is cancelled (which
kills its process), and the sample ends ABORTED, resumable at its tool calls.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import respx

from engine import slime
from engine.local.sample import Sample
from engine.sandbox import UID_BASE, UID_COUNT
from tests.slime.slime_rules import slime_aborting
from tests.support.helpers import IM_END, SAMPLING, URL, ScriptedServer, encode, make_args, reply_body

SLOW = "<code>\nimport time\ntime.sleep(90)\n</code>"


def children() -> set[int]:
    """Live sandboxed processes started from this test process: descendants running as a sandbox uid.

    The sandbox's zygote is a long-lived child of this process by design; the programs it runs
    are its children, each under a leased uid.
    """
    me, parent, uid = os.getpid(), {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                status = (entry / "status").read_text()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(entry.name)] = int(fields[1])
                uid[int(entry.name)] = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:")))

    def descends(pid: int) -> bool:
        for _ in range(64):
            pid = parent.get(pid, 0)
            if pid == me:
                return True
            if pid <= 1:
                return False
        return False

    return {pid for pid in parent if UID_BASE <= uid[pid] < UID_BASE + UID_COUNT and descends(pid)}


def test_abort_while_a_sandboxed_program_runs_cuts_it_and_ends_resumable() -> None:
    server = ScriptedServer([httpx.Response(200, json=reply_body(encode(SLOW) + [IM_END]))])
    sample = Sample(prompt="Sleep, then answer.", label="1")
    args = make_args(partial_rollout=True, engine_tool_timeout=120)

    async def go() -> tuple[set[int], set[int]]:
        task = asyncio.create_task(slime.generate(args, sample, dict(SAMPLING)))
        running: set[int] = set()
        for _ in range(200):  # until the sandbox has started the program
            await asyncio.sleep(0.05)
            running = children()
            if running:
                break
        await asyncio.sleep(0.3)
        with slime_aborting():
            # slime's abort() waits on the sample: it must come back long before the program would
            await asyncio.wait_for(task, 20)
        return running, children()

    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        started, left = asyncio.run(go())
    assert started, "the sandboxed program never started"
    assert not started & left, "the sandboxed program outlived the abort"
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.ABORTED and fsm["termination_reason"] == "abort_requested"
    assert tuple(fsm["trace"][-1]) == ("TOOL_CODE_INTERPRETER", "cancelled", "ABORTED")
    assert fsm["checkpoint"]["resume_at"] == "tools"  # the cut call runs again when slime resumes it
    assert json.dumps(fsm)  # recorded as plain data
