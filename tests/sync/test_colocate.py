"""The colocated step runs its phases in the documented order and times each one."""

import asyncio

from redline.sync.colocate import PHASES, colocated_step


class Recorder:
    """Stands in for the trainer's memory, the engine and the step's callables; logs every call in order."""

    def __init__(self):
        self.calls = []

    def pause(self):
        self.calls.append("trainer.pause")

    def resume(self):
        self.calls.append("trainer.resume")

    async def resume_memory(self, tags):
        self.calls.append(f"engine.resume{sorted(tags)}")

    async def release_memory(self, tags):
        self.calls.append(f"engine.release{sorted(tags)}")

    def step(self, name, result=None):
        def call():
            self.calls.append(name)
            return result
        return call

    def async_step(self, name, result=None):
        async def call():
            self.calls.append(name)
            return result
        return call


def test_phases_run_in_the_colocation_order_and_are_all_timed():
    rec = Recorder()
    trained, generated, report = asyncio.run(colocated_step(
        train=rec.step("train", "loss"), trainer_memory=rec, engine=rec, sync=rec.step("sync"),
        generate=rec.async_step("generate", "tokens"), device="cpu"))
    assert rec.calls == ["train", "trainer.pause", "engine.resume['weights']", "sync", "engine.resume['kv_cache']",
                         "generate", "engine.release['kv_cache', 'weights']", "trainer.resume"]
    assert (trained, generated) == ("loss", "tokens")
    assert list(report.seconds) == list(PHASES) and all(s >= 0 for s in report.seconds.values())
    assert report.transition == sum(report.seconds[p] for p in PHASES if p not in ("train", "generate"))
