"""Rolling out without slime through the face: `engine.roll_out` with the attempts policy, and a
`Runtime` that closes itself as an async context manager."""

from __future__ import annotations

import httpx
import respx

import engine
from tests.conftest import run
from tests.support.helpers import IM_END, URL, FakeInterpreter, ScriptedServer, encode, reply_body

ANSWER = "Answer: \\boxed{42}"


def cfg(**kw: object) -> engine.EngineConfig:
    return engine.EngineConfig(server_url=URL, **kw)


def test_a_transiently_failed_attempt_is_run_again_and_recorded(fake_interpreter: FakeInterpreter) -> None:
    server = ScriptedServer([httpx.Response(200, json=reply_body(encode("cut"), finish="abort")),
                             httpx.Response(200, json=reply_body(encode(ANSWER) + [IM_END]))])

    async def main() -> tuple[object, engine.Runtime]:
        async with engine.Runtime.create(cfg(sample_attempts=2)) as rt:
            sample = await engine.roll_out(rt, "What is 6 * 7?", engine.sampling_params(max_new_tokens=64), label="42")
        return sample, rt

    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        sample, rt = run(main())
    assert sample.status.name == "COMPLETED" and sample.metadata["fsm"]["termination_reason"] == "answered"
    assert [a["reason"] for a in sample.metadata["fsm"]["attempts"]] == ["server_aborted"]
    assert sample.reward["score"] == 1.0 and len(server.requests) == 2
    assert rt.client.http.client.is_closed  # the context manager closed the pool


def test_attempts_spent_end_failed_and_removed_and_groups_keep_input_order(fake_interpreter: FakeInterpreter) -> None:
    aborted = httpx.Response(200, json=reply_body(encode("cut"), finish="abort"))

    async def main() -> list[object]:
        async with engine.Runtime.create(cfg(sample_attempts=2, retry=engine.RetryPolicy(base_delay=0.01))) as rt:
            return await engine.roll_out_all(rt, ["a", "b"], n_samples_per_prompt=2)

    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=ScriptedServer([aborted], repeat_last=True))
        samples = run(main())
    assert [(s.group_index, s.index) for s in samples] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    for s in samples:
        assert s.status.name == "FAILED" and s.remove_sample
        assert s.metadata["fsm"]["termination_reason"] == "attempts_exhausted"
        assert len(s.metadata["fsm"]["attempts"]) == 2
