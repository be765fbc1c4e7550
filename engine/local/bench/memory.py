"""Figure 5: bytes an in-flight sample holds at a 32k-token context.

Each sample is built the way the engine builds it: a `Rollout`, its prompt reset into
the `Trajectory`, then turns of model tokens (through the `append_model_turn` action,
from a parsed `Reply`, so the turn log is kept too) and observations (through
`append_observation`), until the response holds `memory_tokens` tokens. While its request
waits the sample holds no turn's scratch (the driver lets the last one go before it sends; the
response text is made only when the sample ends), and the HTTP client keeps for it its
prompt's ids, encoded once. Traced bytes (tracemalloc) of everything still alive, divided by
the number of samples, are added to what one such sample's request holds while it waits for
its reply, measured on a real loopback socket (`in_flight_request_bytes`: the body is made
when the transport writes it and held by nothing after). The sum is compared with the raw size
of the same ids, logprobs and mask
held as Python lists of boxed ints and floats, and judged against 320 KiB.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import statistics
import sys
import threading
import time
import tracemalloc
from array import array
from typing import Any

import httpx

from engine.settings import EngineConfig, RetryPolicy
from engine.local.bench.common import Figure, Sizes
from engine.machine import actions as a
from engine.machine.rollout import Inputs, Rollout, TurnScratch
from engine.sglang.client import HttpPool, SGLangClient
from engine.sglang.wire import RequestBody, parse_reply

TURN_TOKENS = 900  # model tokens per turn
OBSERVATION_TOKENS = 124  # tool-output tokens per turn
PROMPT_TOKENS = 400
# The prompt's ids as the runtime's cache hands them out: one tuple for every sample of a prompt.
PROMPT_IDS = tuple(range(100000, 100000 + PROMPT_TOKENS))
CHARS_PER_TOKEN = 4  # typical for English text and code with a BPE vocabulary


def _reply_body(turn: int) -> dict[str, Any]:
    ids = [(turn * 131 + i * 17) % 150000 for i in range(TURN_TOKENS)]
    return {
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": "</code>"},
            "weight_version": "default",
            "output_token_logprobs": [[-((i * 7) % 97 + 1) / 64, t, None] for i, t in enumerate(ids)],
        },
    }


def build_sample(cfg: EngineConfig, tokens: int, client: SGLangClient | None = None) -> Rollout:
    """One rollout holding a `tokens`-long response, built through the engine's actions.

    With a `client`, every turn's request body is built as the driver has it built, so the
    client keeps what it keeps for a sample between two turns of a real rollout (its prompt, encoded).
    """
    r = Rollout(Inputs(cfg, prompt="p", sampling_params={"max_new_tokens": TURN_TOKENS}, allowed_tools=frozenset({"code_interpreter"})))
    r.prompt_ids = PROMPT_IDS
    a.reset_rollout(r)
    turn = 0
    while r.traj.response_length < tokens:
        if client is not None:
            client.body(r.traj, r.inputs.sampling_params, TURN_TOKENS)
        turn_text = "x" * (TURN_TOKENS * CHARS_PER_TOKEN - 1) + chr(97 + turn % 26)  # a string of its own, as decode gives
        r.turn = TurnScratch(reply=parse_reply(_reply_body(turn)), text=turn_text)
        a.append_model_turn(r)
        r.turn.observation_ids = [(turn + i) % 150000 for i in range(min(OBSERVATION_TOKENS, tokens - r.traj.response_length))]
        a.append_observation(r)
        turn += 1
    r.traj.trim(tokens)
    r.turn = TurnScratch()  # the driver lets the last turn's scratch go before it sends the next request
    return r


class DrainingServer:
    """A loopback `/generate` server on a thread that answers only when released.

    It reads each request into one reused buffer, so it allocates nothing per byte received
    and the process's traced memory while a request waits is the client's alone. Other paths
    (the model-info probe) get a 404.
    """

    REPLY = (b'{"text":"ab","output_ids":[5,6],"meta_info":{"finish_reason":{"type":"stop"},'
             b'"output_token_logprobs":[[-0.5,5,null],[-0.25,6,null]]}}')

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.received, self.release = threading.Event(), threading.Event()
        self.body_bytes = 0
        self._chunk = bytearray(1 << 16)  # made before any count starts
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            with conn:
                while self._answer(conn):
                    pass

    def _answer(self, conn: socket.socket) -> bool:
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(4096)
            if not data:
                return False
            head += data
        head, rest = head.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = next((int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:")), 0)
        left = length - len(rest)
        while left > 0:
            got = conn.recv_into(self._chunk, min(len(self._chunk), left))
            if not got:
                return False
            left -= got
        if not head.startswith(b"POST /generate"):
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return True
        self.body_bytes = length
        self.received.set()
        self.release.wait(30)
        self.release.clear()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(self.REPLY), self.REPLY))
        return True

    def close(self) -> None:
        self.release.set()
        self.listener.close()


class _Ids:
    """A trajectory's two arrays: a 400-token prompt and a 32k-token response."""

    def __init__(self, tokens: int) -> None:
        self.prompt_ids = array("i", PROMPT_IDS)
        self.response_ids = array("i", [100000 + i % 50000 for i in range(tokens)])


def in_flight_request_bytes(tokens: int = 32768, repeats: int = 3, hook: Any = None) -> tuple[float, int]:
    """Traced bytes the client holds while one sample's `/generate` request waits for its reply
    (median of `repeats`), and the size of that request's body.

    The request goes through `SGLangClient.generate` to a `DrainingServer`; the bytes are counted
    once the server has read the whole body and before it answers. `hook`: an httpx request
    event hook to register (hooks see the body's bytes, so then they are kept).
    """
    server = DrainingServer()

    async def main() -> list[int]:
        pool = HttpPool(4, httpx.Timeout(30.0))
        if hook is not None:
            pool.add_event_hook("request", hook)
        client = SGLangClient(server.url, pool, RetryPolicy(), vocab_size=200000)
        ids, held = _Ids(tokens), []
        try:
            for n in range(repeats + 1):  # the first request warms what every request shares
                server.received.clear()
                gc.collect()
                tracemalloc.start()
                before = tracemalloc.get_traced_memory()[0]
                task = asyncio.ensure_future(client.generate(ids, {}, 8))
                waited = time.perf_counter()
                while not server.received.is_set():
                    if task.done() or time.perf_counter() - waited > 30:
                        task.cancel()
                        raise RuntimeError(f"the request never reached the draining server: {task}")
                    await asyncio.sleep(0.002)
                if n:
                    held.append(tracemalloc.get_traced_memory()[0] - before)
                tracemalloc.stop()
                server.release.set()
                reply = await task
                if getattr(reply, "ids", None) != [5, 6]:
                    raise RuntimeError(f"the draining server's reply was not read back: {reply}")
            return held
        finally:
            await pool.aclose()

    try:
        held = asyncio.run(main())
    finally:
        server.close()
    return statistics.median(held), server.body_bytes


def list_bytes(ids: list[int], logprobs: list[float], mask: list[int]) -> int:
    """sys.getsizeof of the three lists plus every element object they point to.

    Small ints (-5..256) are shared singletons in CPython, so they add nothing per sample;
    every other int and every float is an object of its own, as after JSON parsing.
    """
    total = sum(sys.getsizeof(x) for x in (ids, logprobs, mask))
    total += sum(sys.getsizeof(i) for i in ids if not -5 <= i <= 256)
    total += sum(sys.getsizeof(f) for f in logprobs)
    return total


def memory_figure(sizes: Sizes) -> Figure:
    """Traced bytes per sample plus what its request holds in flight, against the same per-token
    data as Python lists."""
    cfg = EngineConfig(max_turns=100_000, max_tool_calls=1_000_000)  # the most each allows
    tokens, n = sizes.memory_tokens, sizes.memory_samples
    client = SGLangClient("http://127.0.0.1:1", None, RetryPolicy())  # type: ignore[arg-type]  # bodies only
    build_sample(cfg, 2 * TURN_TOKENS, client)  # what a first body imports (numpy) is not a sample's
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        samples = [build_sample(cfg, tokens, client) for _ in range(n)]
        for r in samples:  # the body of the next request, as the driver would send it now
            client.body(r.traj, r.inputs.sampling_params, TURN_TOKENS)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        client._bodies.clear()
        gc.collect()
        without_prompt = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    in_flight, body = in_flight_request_bytes(tokens)
    per_sample = (after - before) / n + in_flight
    one = samples[0]
    traj = one.traj
    arrays = sum(x.buffer_info()[1] * x.itemsize for x in (traj.prompt_ids, traj.response_ids, traj.logprobs))
    raw = list_bytes(traj.response_ids.tolist(), traj.logprobs.tolist(), traj.loss_mask.tolist())
    return Figure(
        "memory", f"bytes per in-flight sample, {tokens}-token response, its request waiting ({n} samples)",
        per_sample, "B", float(raw), "ids+logprobs+mask as Python lists", "value", "<=", float(320 << 10), 1,
        {"array_payload_bytes": arrays, "in_flight_request_bytes": in_flight, "request_body_bytes": body,
         "encoded_prompt_bytes": (after - without_prompt) / n, "turns": one.turn_count, "bytes_per_token": per_sample / tokens},
    )


def body_figure(tokens: int, rounds: int = 200) -> Figure:
    """The CPU price of keeping no body between turns: a turn's body for a `tokens`-long response,
    its prompt already encoded, against extending a kept body (the copy that would cost)."""
    ids, body = _Ids(tokens), RequestBody()
    params = {"temperature": 1.0, "max_new_tokens": 1024}
    kept = body.render(ids.prompt_ids, ids.response_ids, params, 1024)
    tail = kept[-60:]

    def per_call(fn: Any) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(rounds):
                fn()
            times.append((time.perf_counter() - start) / rounds)
        return statistics.median(times) * 1e6

    made = per_call(lambda: body.render(ids.prompt_ids, ids.response_ids, params, 1024))
    extended = per_call(lambda: b"".join((memoryview(kept)[:-60], b",7", tail)))
    return Figure(
        "memory_body", f"a turn's request body at {tokens} response tokens, made from the arrays (nothing kept)",
        made, "us", extended, "extending a kept body", None, None, None, 5,
    )
