"""What engine fault tolerance costs the step when nothing fails (issue 18's Ray overhead).

    python benchmarks/bench_fault_tolerance.py [--samples 200] [--rounds 40]

1. A rollout's generate calls, one per sample as the loop makes them, all in flight at once, to an instant stand-in
   engine: bare, and behind ``FaultTolerantEngine``. Median ms per rollout; the difference is the event-loop work
   fault tolerance adds to every rollout.
2. Before each weight push ``replace_dead`` checks the engines: a health round trip through an embedded engine
   process's request queue (``health()``), against the look at its process that now stands in for it when the
   engine answered within the interval (``running()``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from redline.rollout.fault_tolerance import FaultTolerantEngine


class InstantEngine:
    """Answers at the next turn of the event loop: what is left is the callers' own overhead."""

    pid = 0

    async def generate(self, requests):
        await asyncio.sleep(0)
        return list(requests)

    async def health(self):
        return True

    def kill(self):
        pass


def rollout_ms(engine, samples: int, rounds: int) -> float:
    async def rollout():
        await asyncio.gather(*(engine.generate([i]) for i in range(samples)))

    async def timed():
        for _ in range(3):  # warm-up
            await rollout()
        times = []
        for _ in range(rounds):
            began = time.perf_counter()
            await rollout()
            times.append(time.perf_counter() - began)
        return statistics.median(times) * 1e3

    return asyncio.run(timed())


async def health_check_ms(rounds: int) -> tuple[float, float]:
    from redline.rollout.embedded.process import EmbeddedEngineProcess
    from redline.rollout.model_dir import make_model_dir

    engine = EmbeddedEngineProcess(make_model_dir(tempfile.mkdtemp()), max_batch_size=2, max_seq_len=64)
    asked, looked = [], []
    try:
        for _ in range(rounds):
            began = time.perf_counter()
            await engine.health()
            asked.append(time.perf_counter() - began)
            began = time.perf_counter()
            engine.running()
            looked.append(time.perf_counter() - began)
            await asyncio.sleep(0.005)
    finally:
        await engine.shutdown()
    return statistics.median(asked) * 1e3, statistics.median(looked) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200, help="generate calls per rollout (the quickstarts: 200)")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    bare = rollout_ms(InstantEngine(), args.samples, args.rounds)
    watched = rollout_ms(FaultTolerantEngine(InstantEngine), args.samples, args.rounds)
    print(f"rollout of {args.samples} generate calls: bare {bare:.2f} ms, behind FaultTolerantEngine {watched:.2f} ms "
          f"(+{watched - bare:.2f} ms)")
    asked, looked = asyncio.run(health_check_ms(5 * args.rounds))
    print(f"before a push, per engine process: health round trip {asked:.3f} ms, running() {looked * 1e3:.1f} us")


if __name__ == "__main__":
    main()
