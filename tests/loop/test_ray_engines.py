"""``RayEngine``: the generate calls of one event-loop turn reach the engine actor as one call, whose answers
stream back as they finish; each caller gets its own answers once they are all back (or the engine's error). A
stand-in actor: no Ray runtime needed."""

import asyncio

import pytest
from redline.loop.ray_engines import RayEngine, packed, unpacked


class StandInActor:
    """``actor.generate_each.options(num_returns="streaming").remote(requests)`` as Ray's handle has it: an async
    iterator of awaitables, each a ``packed`` chunk of ``(index, answer)``. A request ``"x@s"`` finishes in chunk ``s``
    (default 0); ``fail_after``: the stream raises after that many chunks."""

    def __init__(self, fail_after: int | None = None):
        self.calls, self.fail_after = [], fail_after
        self.generate_each = self

    def options(self, **options):
        assert options == {"num_returns": "streaming"}
        return self

    def remote(self, requests):
        requests = unpacked(requests)
        self.calls.append(list(requests))
        return self._stream(requests)

    async def _stream(self, requests):
        steps = [int(r.partition("@")[2] or 0) for r in requests]
        for chunk, step in enumerate(sorted(set(steps))):
            await asyncio.sleep(0)
            if chunk == self.fail_after:
                raise RuntimeError("engine gone")
            yield asyncio.sleep(0, packed([(i, f"answer to {r}") for i, r in enumerate(requests) if steps[i] == step]))


def test_one_turns_generate_calls_are_one_actor_call_and_each_caller_gets_its_answers():
    actor = StandInActor()
    engine = RayEngine(actor, where={})

    async def scenario():
        first = await asyncio.gather(engine.generate(["a"]), engine.generate(["b", "c"]), engine.generate(["d"]))
        later = await engine.generate(["e"])
        return first, later

    first, later = asyncio.run(scenario())
    assert first == [["answer to a"], ["answer to b", "answer to c"], ["answer to d"]]
    assert later == ["answer to e"]
    assert actor.calls == [["a", "b", "c", "d"], ["e"]]


def test_each_caller_is_answered_as_its_own_requests_finish():
    engine = RayEngine(StandInActor(), where={})
    answered = []

    async def caller(requests):
        answer = await engine.generate(requests)
        answered.append(requests)
        return answer

    async def scenario():
        return await asyncio.gather(caller(["slow@2"]), caller(["fast@0", "middle@1"]), caller(["first@0"]),
                                    caller([]))

    results = asyncio.run(scenario())
    assert results == [["answer to slow@2"], ["answer to fast@0", "answer to middle@1"], ["answer to first@0"], []]
    # a caller waits for its own slowest request only, not for the batch's
    assert answered == [[], ["first@0"], ["fast@0", "middle@1"], ["slow@2"]]


def test_an_engine_error_reaches_every_caller_still_waiting():
    engine = RayEngine(StandInActor(fail_after=1), where={})

    async def scenario():
        return await asyncio.gather(engine.generate(["a@0"]), engine.generate(["b@1"]), engine.generate(["c@2"]),
                                    return_exceptions=True)

    done, *failed = asyncio.run(scenario())
    assert done == ["answer to a@0"]
    assert len(failed) == 2 and all(isinstance(r, RuntimeError) and "engine gone" in str(r) for r in failed)


def test_a_cancelled_caller_leaves_the_others_their_answers():
    engine = RayEngine(StandInActor(), where={})

    async def scenario():
        kept, dropped = asyncio.ensure_future(engine.generate(["a"])), asyncio.ensure_future(engine.generate(["b"]))
        await asyncio.sleep(0)  # both queued in this turn
        dropped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        return await kept

    assert asyncio.run(scenario()) == ["answer to a"]


def test_the_host_streams_answers_in_chunks_of_those_finished_and_cancels_the_rest_on_a_failure():
    from redline.loop.ray_engines import as_they_finish

    async def answer(value, ticks, fail=False):
        for _ in range(ticks):
            await asyncio.sleep(0)
        if fail:
            raise RuntimeError("request failed")
        return [value]

    async def scenario():
        calls = [asyncio.ensure_future(answer(v, t)) for v, t in (("a", 20), ("b", 1), ("c", 1))]
        chunks = [sorted(chunk) async for chunk in as_they_finish(calls)]
        slow = asyncio.ensure_future(answer("d", 50))
        failing = as_they_finish([asyncio.ensure_future(answer("e", 1, fail=True)), slow])
        with pytest.raises(RuntimeError, match="request failed"):
            async for _ in failing:
                pass
        await asyncio.sleep(0)
        return chunks, slow.cancelled()

    chunks, cancelled = asyncio.run(scenario())
    assert chunks == [[(1, "b"), (2, "c")], [(0, "a")]]
    assert cancelled
