"""Attempts of one sample: ABORTED only for a caller that re-queues it, else a bounded re-run.

The machine ends an *attempt* at ABORTED for transient failures (the server aborted, an
unusable reply, retries spent, a broken invariant). Whether ABORTED may be handed back
depends on the caller: slime re-queues an ABORTED sample only while it is aborting the
step or from its fully-async worker; its default synchronous loop trains it with
`reward=None` and the step dies. So:

- the caller will re-queue (the runtime's abort check holds, the fully-async worker calls,
  or the setting `engine_abort_status: aborted`): the ABORTED attempt is handed back, with
  its partial-rollout checkpoint when that is on;
- otherwise the sample is run again from RESET (a fresh `Rollout` on the same input: I5
  makes it end as a fresh one would), at most `sample_attempts` times and not after
  `sample_deadline` seconds. Each failed attempt is recorded with its reason. When none
  finishes, the outcome is `exhausted`: the adapter ends the sample in a status slime
  trains safely (see `engine.slime.sample_io.write_sample`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import attrs

from engine.loop.driver import drive
from engine.loop.runtime import Runtime
from engine.machine.rollout import Rollout
from engine.machine.states import State

EXHAUSTED = "attempts_exhausted"  # the termination reason of a sample no attempt could finish


@attrs.define(eq=False)
class Outcome:
    """The last attempt, the failed ones before it, and whether the sample could not finish."""

    rollout: Rollout
    attempts: list[dict[str, Any]] = attrs.field(factory=list)
    exhausted: bool = False


def caller_requeues(rt: Runtime) -> bool:
    """Whether an ABORTED sample will be re-queued by whoever called (so it may be handed back).

    slime's fully-async worker re-queues a group holding an ABORTED sample, but reads the status
    of each element: one inside a list (fan-out) it does not see, and would train."""
    return (rt.cfg.abort_status == "aborted" or (rt.cfg.fully_async and not rt.fans_out())
            or rt.abort_requested())


def attempt_record(number: int, r: Rollout, seconds: float) -> dict[str, Any]:
    """What `metadata["fsm"]["attempts"]` keeps of a failed attempt."""
    return {"attempt": number, "reason": r.record.reason, "error": r.record.error, "turns": r.turn_count, "seconds": round(seconds, 6)}


async def run_attempts(
    rt: Runtime, make: Callable[[int], Rollout], on_start: Callable[[Rollout], None] | None = None
) -> Outcome:
    """Drive attempts made by `make(number)` (1-based) until one may be handed back.

    `on_start` sees each attempt's rollout before it runs, so a caller that is cancelled
    still knows the attempt in flight. Re-raises only CancelledError (from `drive`).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + rt.cfg.sample_deadline
    failed: list[dict[str, Any]] = []
    number = 0
    while True:
        number += 1
        r = make(number)
        if on_start is not None:
            on_start(r)
        started = time.perf_counter()
        await drive(rt, r)
        if r.state != State.ABORTED or caller_requeues(rt):
            return Outcome(r, failed)
        failed.append(attempt_record(number, r, time.perf_counter() - started))
        if number >= rt.cfg.sample_attempts or loop.time() >= deadline:
            return Outcome(r, failed, exhausted=True)
        await asyncio.sleep(min(rt.cfg.retry.base_delay * number, max(0.0, deadline - loop.time())))
