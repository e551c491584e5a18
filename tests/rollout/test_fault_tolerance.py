"""``FaultTolerantEngine`` over stand-in engine processes: a dead or hung engine is found within the health-check
interval, its requests are answered by a healthy engine exactly once, and its replacement gets the weights before
it serves."""

import asyncio
import itertools

import pytest
from redline.rollout.fault_tolerance import FaultTolerantEngine


class StandIn:
    """An engine process stand-in: answers each request with ``(name, request)``; ``dead`` makes it stop answering
    (its calls hang, its health check fails), ``hung`` makes it stop answering health checks too (no reply);
    ``kill()`` fails the calls still waiting, as ``EmbeddedEngineProcess.kill`` does."""

    names = itertools.count()

    def __init__(self):
        self.name = f"engine{next(self.names)}"
        self.dead = self.hung = self.killed = False
        self.weights = None
        self.served = []
        self.started = asyncio.Event()  # set once a request is being served (the test kills it then)
        self.gone = asyncio.Event()  # set by kill()

    async def generate(self, requests):
        self.started.set()
        await asyncio.sleep(0.01)
        if self.dead or self.hung:
            await self.gone.wait()
            raise RuntimeError(f"{self.name} was killed")
        self.served += requests
        return [(self.name, self.weights, r) for r in requests]

    async def health(self):
        if self.hung:
            await asyncio.sleep(3600)
        return not self.dead

    def kill(self):
        self.killed = True
        self.gone.set()

    async def shutdown(self):
        pass


def started_engines():
    made = []

    def start():
        made.append(StandIn())
        return made[-1]
    return made, start


@pytest.mark.parametrize("failure", ["dead", "hung"])
def test_requests_of_a_failed_engine_are_answered_once_by_a_healthy_one(failure):
    made, start = started_engines()

    async def scenario():
        engines = FaultTolerantEngine(start, count=2, interval=0.05, timeout=0.1)
        restored = []

        async def restore(engine):
            engine.weights = "v3"  # the current weights, before the engine serves
            restored.append(engine)
        engines.restore = restore
        first = made[0]
        setattr(first, failure, True)  # engine 0 takes requests and never answers them
        results = await asyncio.gather(*(engines.generate([f"r{i}"]) for i in range(6)))
        await engines.shutdown()
        return engines, restored, results

    engines, restored, results = asyncio.run(scenario())
    first, second, replacement = made
    assert [r[0][2] for r in results] == [f"r{i}" for i in range(6)]  # every request answered, in order, once
    assert {r[0][0] for r in results} <= {second.name, replacement.name}
    assert first.killed and restored == [replacement]
    assert engines.restarts == 1 and engines.retried_requests == 3  # r0, r2, r4 went to engine 0 first
    assert sorted(second.served + replacement.served) == [f"r{i}" for i in range(6)]
    assert all(r[0][1] == "v3" for r in results if r[0][0] == replacement.name)
    assert engines.take_metrics() == {"rollout/engine_restarts": 1.0, "rollout/retried_requests": 3.0}
    assert engines.take_metrics() == {"rollout/engine_restarts": 0.0, "rollout/retried_requests": 0.0}


def test_a_lone_engine_that_dies_serves_its_requests_after_its_restart():
    made, start = started_engines()

    async def scenario():
        engines = FaultTolerantEngine(start, interval=0.05, timeout=0.1)
        engines.restore = lambda engine: asyncio.sleep(0)
        calls = [asyncio.ensure_future(engines.generate([f"r{i}"])) for i in range(3)]
        await made[0].started.wait()
        made[0].dead = True
        return await asyncio.gather(*calls), engines

    results, engines = asyncio.run(scenario())
    assert [r[0][0] for r in results] == [made[1].name] * 3 and engines.restarts == 1


def test_an_engine_is_not_checked_before_its_first_wait():
    made, start = started_engines()

    async def scenario():
        engines = FaultTolerantEngine(start, interval=0.02, timeout=0.05, first_wait=3600)
        made[0].dead = True
        call = asyncio.ensure_future(engines.generate(["r0"]))
        await asyncio.sleep(0.2)
        call.cancel()
        return engines

    assert asyncio.run(scenario()).restarts == 0


def test_a_failed_restart_fails_the_waiting_calls():
    made, start = started_engines()

    def start_once():
        if made:
            raise RuntimeError("no GPU memory")
        return start()

    async def scenario():
        engines = FaultTolerantEngine(start_once, interval=0.05, timeout=0.1)
        made[0].dead = True
        await engines.generate(["r0"])

    with pytest.raises(RuntimeError, match="no GPU memory"):
        asyncio.run(scenario())


@pytest.mark.slow  # starts a spawned Python process (a few seconds)
def test_a_killed_engine_process_fails_its_waiting_calls_and_reports_unhealthy(model_dir, tokenizer):
    import os
    import signal

    from redline.rollout.embedded.process import EmbeddedEngineProcess, EngineProcessDied
    from redline.rollout.types import GenerateRequest, SamplingParams

    request = GenerateRequest(tokenizer.encode("What is 2 + 3?"), SamplingParams(temperature=1.0, max_new_tokens=48))

    async def scenario():
        engine = EmbeddedEngineProcess(model_dir, max_batch_size=2, max_seq_len=64)
        await engine.generate([request])  # serving
        os.kill(engine.pid, signal.SIGKILL)
        await asyncio.to_thread(engine._process.join)
        healthy = await engine.health()
        waiting = asyncio.ensure_future(engine.generate([request]))  # sent to a dead process: no answer comes
        await asyncio.sleep(0.2)
        assert not waiting.done()
        engine.kill()
        with pytest.raises(EngineProcessDied):
            await waiting
        await engine.shutdown()  # a no-op after kill
        return healthy

    assert asyncio.run(scenario()) is False


class ProcessStandIn(StandIn):
    """A stand-in that tells whether its process runs (``running()``) and counts its health checks."""

    def __init__(self):
        super().__init__()
        self.exited = False
        self.health_checks = 0

    def running(self):
        return not self.exited

    async def health(self):
        self.health_checks += 1
        return await super().health()


def test_before_a_push_only_an_engine_not_known_to_run_is_asked():
    made = []

    def start():
        made.append(ProcessStandIn())
        return made[-1]

    async def scenario():
        engines = FaultTolerantEngine(start, count=2, interval=3600, timeout=0.1)
        engines.restore = lambda engine: asyncio.sleep(0)
        await asyncio.gather(*(engines.generate([f"r{i}"]) for i in range(2)))  # both answered just now
        await engines.replace_dead()
        asked_while_running = [e.health_checks for e in made]
        made[1].exited = made[1].dead = True  # its process is gone (a SIGKILL while the trainer trained)
        await engines.replace_dead()
        await engines.shutdown()
        return engines, asked_while_running

    engines, asked_while_running = asyncio.run(scenario())
    assert asked_while_running == [0, 0]  # no round trip to engines that run and answered within the interval
    assert made[1].health_checks == 1 and made[1].killed and engines.restarts == 1 and len(made) == 3
    assert made[0].health_checks == 0
