"""``RayEngine``: the generate calls of one event-loop turn reach the engine actor as one call, and each caller gets
its own answers (or the engine's error). A stand-in actor: no Ray runtime needed."""

import asyncio

import pytest
from redline.loop.ray_engines import RayEngine


class StandInActor:
    """``actor.call.remote(method, *args)`` as Ray's handle has it: an awaitable of the method's result."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail
        self.call = self

    def remote(self, method, *args):
        self.calls.append((method, *args))

        async def answer():
            await asyncio.sleep(0)
            if self.fail:
                raise RuntimeError("engine gone")
            (requests,) = args
            return [f"answer to {r}" for r in requests]
        return answer()


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
    assert actor.calls == [("generate", ["a", "b", "c", "d"]), ("generate", ["e"])]


def test_an_engine_error_reaches_every_caller_of_the_batch():
    engine = RayEngine(StandInActor(fail=True), where={})

    async def scenario():
        return await asyncio.gather(engine.generate(["a"]), engine.generate(["b"]), return_exceptions=True)

    results = asyncio.run(scenario())
    assert len(results) == 2 and all(isinstance(r, RuntimeError) and "engine gone" in str(r) for r in results)


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
