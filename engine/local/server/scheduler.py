"""The generation scheduler: one worker thread owns the model and interleaves requests.

Requests are not batched into one forward pass: each loop iteration admits (prefills) at most one
waiting request and then advances every running request by one token, round-robin. So all model
work happens on one thread (one forward at a time, no lock needed), long generations do not starve
short ones, and `/abort_request` takes effect at the next token. Results go back to the asyncio
loop that submitted them through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections import deque
from typing import Any

import attrs
import torch

from engine.local.server.model import LMBackend, kept_token_ids, reported_logprobs, sample_token
from engine.local.server.protocol import GenerateSpec, GenerationResult, RequestError, output_text
from engine.local.server.replay import ReplayScript

log = logging.getLogger(__name__)
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}  # no status_code/err_type keys


@attrs.define(eq=False)
class _Job:
    spec: GenerateSpec
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    aborted: bool = False  # set from the event-loop thread; a plain bool read is atomic under the GIL
    cache: Any = None
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    output_ids: list[int] = attrs.Factory(list)
    logprobs: list[tuple[float, int]] = attrs.Factory(list)
    top_p: list[list[int]] = attrs.Factory(list)


@attrs.define
class SchedulerStats:
    """Counters for /server_info and for measuring latency."""

    requests: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    replayed_turns: int = 0


class Scheduler:
    """Owns the backend on one worker thread; `submit` / `abort` / `loads` are thread-safe."""

    def __init__(self, backend: LMBackend, *, replay: ReplayScript | None = None, seed: int = 0,
                 max_running: int = 64, torch_threads: int = 1) -> None:
        self.backend = backend
        self.replay = replay
        self.max_running = max_running
        self.stats = SchedulerStats()
        self._torch_threads = torch_threads
        self._seeds = random.Random(seed)  # seeds requests without sampling_seed, reproducibly
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._turn_ids: dict[str, list[int]] = {}
        self._thread = threading.Thread(target=self._run, name="embedded-sglang-worker", daemon=True)
        self._stopping = False

    # ---- called from other threads -----------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the worker thread."""
        self.abort("", abort_all=True)
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread.is_alive() and not self._stopping

    def submit(self, spec: GenerateSpec) -> asyncio.Future[GenerationResult]:
        """Queue a request; must be called on the event loop that will await the future."""
        loop = asyncio.get_running_loop()
        job = _Job(spec=spec, loop=loop, future=loop.create_future())
        with self._lock:
            if spec.rid in self._jobs:
                raise RequestError.message(f"Duplicate request ID detected: {spec.rid}")
            self._jobs[spec.rid] = job
            self.stats.requests += 1
        self._inbox.put(job)
        return job.future

    def abort(self, rid: str, abort_all: bool = False, exact: bool = False) -> int:
        """Mark in-flight requests whose rid starts with `rid` (equals it if `exact`; all with
        `abort_all`) as aborted; returns how many were marked."""
        if not rid and not abort_all:
            return 0  # SGLang ignores an empty rid unless abort_all
        with self._lock:
            hits = [job for r, job in self._jobs.items() if abort_all or (r == rid if exact else r.startswith(rid))]
            for job in hits:
                job.aborted = True
        if hits:
            self._inbox.put(None)  # wake the worker if it is idle
        return len(hits)

    def loads(self) -> tuple[int, int]:
        """(running, waiting) request counts; waiting includes requests not yet seen by the worker."""
        with self._lock:
            total = len(self._jobs)
        running = len(self._running)
        return running, max(0, total - running)

    # ---- worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)  # two servers on two cores must not thrash
        while not self._stopping:
            self._drain(block=not (self._waiting or self._running))
            for job in [j for j in self._waiting if j.aborted]:
                self._waiting.remove(job)
                self._finish(job, ABORT_WAITING, queued=True)
            if self._waiting and len(self._running) < self.max_running:
                self._guarded(self._waiting.popleft(), self._admit)
            for job in list(self._running):
                if job.aborted:
                    self._finish(job, ABORT_RUNNING)
                else:
                    self._guarded(job, self._advance)
        # Stopping: nothing may be left waiting forever on a future.
        self._drain(block=False)
        for job in list(self._waiting):
            self._finish(job, ABORT_WAITING, queued=True)
        for job in list(self._running):
            self._finish(job, ABORT_RUNNING)
        self._waiting.clear()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _guarded(self, job: _Job, step: Any) -> None:
        try:
            step(job)
        except Exception as exc:  # one bad request must not kill the worker
            log.exception("request %s failed", job.spec.rid)
            if job in self._running:
                self._running.remove(job)
            self._deliver(job, exc)

    def _admit(self, job: _Job) -> None:
        spec = job.spec
        seed = spec.seed if spec.seed is not None else self._seeds.getrandbits(63)
        job.generator = torch.Generator().manual_seed(seed)
        job.cache = self.backend.new_cache()
        forced = self._scripted_turn(spec)
        t0 = time.perf_counter()
        if forced is not None:
            self._teacher_force(job, forced)
        else:
            logits = self.backend.prefill(list(spec.input_ids), job.cache)
            if spec.max_new_tokens == 0:
                # SGLang quirk: a prefill-only request still reports one output logprob entry.
                token, logprob = sample_token(logits, spec.sampler, job.generator)
                job.logprobs.append((logprob, token))
                self._finish(job, {"type": "length", "length": 0})
            else:
                job.next_logits = logits
                self._running.append(job)
        self.stats.prefill_tokens += len(spec.input_ids)
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _scripted_turn(self, spec: GenerateSpec) -> list[int] | None:
        if self.replay is None:
            return None
        text = self.replay.turn_text(self.backend.decode(list(spec.input_ids)))
        if text is None:
            return None
        if text not in self._turn_ids:
            ids = self.backend.encode(text)
            if not ids or ids[-1] not in self.backend.eos_ids:
                ids.append(self.backend.tokenizer.convert_tokens_to_ids("<|im_end|>"))
            self._turn_ids[text] = ids
        self.stats.replayed_turns += 1
        return self._turn_ids[text]

    def _teacher_force(self, job: _Job, forced: list[int]) -> None:
        """Score the scripted tokens in one forward pass, then apply the usual stop rules."""
        spec = job.spec
        logits = self.backend.score(list(spec.input_ids), forced, job.cache)
        logprobs = reported_logprobs(logits, spec.sampler)
        if spec.max_new_tokens == 0:
            job.logprobs.append((float(logprobs[0, forced[0]]), forced[0]))
            self._finish(job, {"type": "length", "length": 0})
            return
        for i, token in enumerate(forced):
            job.output_ids.append(token)
            job.logprobs.append((float(logprobs[i, token]), token))
            if spec.return_top_p:
                job.top_p.append(kept_token_ids(logits[i], spec.sampler))
            finish = self._check_finish(job)
            if finish is not None:
                self._finish(job, finish)
                return
        # The script ran out without a stop (only possible with ignore_eos): end like a model turn.
        self._finish(job, {"type": "stop", "matched": forced[-1]})

    def _advance(self, job: _Job) -> None:
        t0 = time.perf_counter()
        assert job.next_logits is not None and job.generator is not None
        if job.spec.return_top_p:
            job.top_p.append(kept_token_ids(job.next_logits, job.spec.sampler))
        token, logprob = sample_token(job.next_logits, job.spec.sampler, job.generator)
        job.output_ids.append(token)
        job.logprobs.append((logprob, token))
        finish = self._check_finish(job)
        if finish is not None:
            self._finish(job, finish)
        else:
            job.next_logits = self.backend.step(token, job.cache)
        self.stats.decode_tokens += 1
        self.stats.decode_seconds += time.perf_counter() - t0

    def _check_finish(self, job: _Job) -> dict[str, Any] | None:
        """SGLang's order: the length cap first, then stop tokens, then stop strings."""
        spec, out = job.spec, job.output_ids
        if len(out) >= spec.max_new_tokens:
            return {"type": "length", "length": spec.max_new_tokens}
        if out[-1] in spec.stop_ids:
            return {"type": "stop", "matched": out[-1]}
        if spec.stop_strs:
            tail = self.backend.decode(out[-spec.stop_window:])
            for stop in spec.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def _finish(self, job: _Job, finish: dict[str, Any], queued: bool = False) -> None:
        if job in self._running:
            self._running.remove(job)
        job.cache = job.next_logits = None  # free the KV cache now, not when the future is collected
        spec = job.spec
        token_texts = None
        if spec.return_text_in_logprobs:
            token_texts = [self.backend.decode([t]) for _, t in job.logprobs]
        result = GenerationResult(
            output_ids=job.output_ids, logprobs=job.logprobs, finish=finish, token_texts=token_texts,
            text=output_text(self.backend, spec, job.output_ids, finish), prompt_tokens=len(spec.input_ids),
            queued_abort=queued, top_p=job.top_p[: len(job.output_ids)] if spec.return_top_p else None)
        self._deliver(job, result)

    def _deliver(self, job: _Job, outcome: GenerationResult | BaseException) -> None:
        with self._lock:
            self._jobs.pop(job.spec.rid, None)

        def resolve() -> None:
            if job.future.done():
                return  # the HTTP handler went away
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

        try:
            job.loop.call_soon_threadsafe(resolve)
        except RuntimeError:
            pass  # the event loop is closed: nobody waits for this result any more
