"""``redline.loop.ray_rollout``'s relay: the rollout manager actor's engine calls run on the rank's engine, on the
loop the rank awaits its batch on (here a thread of its own); no Ray runtime needed."""

import asyncio
import threading

import pytest
from redline.loop import ray_rollout


class StandInEngine:
    """Answers request ``r`` after ``r`` turns of its loop (or fails on ``"bad"``), recording the loop it ran on."""

    def __init__(self):
        self.loops, self.calls = set(), []

    async def generate(self, requests):
        self.loops.add(asyncio.get_running_loop())
        self.calls.append(list(requests))
        (request,) = requests
        if request == "bad":
            raise RuntimeError("engine failed")
        for _ in range(request):
            await asyncio.sleep(0)
        return [f"answer to {request}"]

    async def pause(self):
        self.loops.add(asyncio.get_running_loop())
        return "paused"


@pytest.fixture
def rank():
    """A rank's manager handle serving ``StandInEngine`` on a loop in another thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    manager = type("Handle", (), {})()
    manager.engine, manager._loop = StandInEngine(), loop
    ray_rollout._served["manager"] = manager
    yield manager
    del ray_rollout._served["manager"]
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def test_each_request_is_a_call_of_its_own_on_the_ranks_loop_and_every_answer_comes_back_once(rank):
    async def scenario():
        return [chunk async for chunk in ray_rollout.relay_each([30, 0, 5, 0])]

    chunks = asyncio.run(scenario())
    answers = dict(item for chunk in chunks for item in chunk)
    assert answers == {0: "answer to 30", 1: "answer to 0", 2: "answer to 5", 3: "answer to 0"}
    assert sum(map(len, chunks)) == 4 and chunks[-1] == [(0, "answer to 30")]  # the slowest last
    assert sorted(rank.engine.calls) == [[0], [0], [5], [30]] and rank.engine.loops == {rank._loop}


def test_an_engine_error_ends_the_stream_and_other_calls_answer_on_the_ranks_loop(rank):
    async def scenario():
        with pytest.raises(RuntimeError, match="engine failed"):
            async for _ in ray_rollout.relay_each([1000, "bad"]):
                pass
        return await ray_rollout.relay("pause")

    assert asyncio.run(scenario()) == "paused"
    assert rank.engine.loops == {rank._loop}
