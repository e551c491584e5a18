"""What streaming a rollout's answers between Ray actors costs, one chunk per finished answer against chunks that
gather what finished while the reader was behind (``redline.loop.ray_engines.STREAM_BACKLOG``).

    python3 benchmarks/bench_ray_stream.py OUTDIR [--answers 200] [--spread-ms 200] [--score-ms 0,0.5] [--repeats 7]

An engine actor answers ``--answers`` one-request generate calls, finishing them evenly over ``--spread-ms`` (as an
SGLang server's HTTP responses come back one by one), through redline's own ``as_they_finish`` stream; the reader is
a ``RayEngine`` in another actor making the calls in one event-loop turn, as the rollout manager does, and
holding its event loop ``--score-ms`` per answer once it has it (the manager scoring a sample). Per setting:
the median over the repeats of the time from the calls until the reader is done, less the spread (what the stream
and the reader add after the engine's last answer), and the chunks the stream carried. Writes
OUTDIR/ray-stream.json and .md, and the machine and versions beside them (``environment.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from redline.env_report import write_environment

SETTINGS = {"one chunk per answer (no backpressure)": -1, "STREAM_BACKLOG = 1 (redline's)": 1}


class StaggeredEngine:
    """An engine actor's ``generate_each`` (as ``EngineHost``'s) over requests that are delays in seconds."""

    def __init__(self):
        self.chunks = 0

    async def generate_each(self, requests: bytes):
        from redline.loop.ray_engines import as_they_finish, packed, unpacked

        async def answer(delay):
            await asyncio.sleep(delay)
            return [delay]

        async for finished in as_they_finish([asyncio.ensure_future(answer(r)) for r in unpacked(requests)]):
            self.chunks += 1
            yield packed(finished)

    def take_chunks(self) -> int:
        chunks, self.chunks = self.chunks, 0
        return chunks


class Reader:
    """The rollout manager's side: one ``RayEngine.generate`` call per answer, made in one turn."""

    def __init__(self, engine):
        self.engine = engine

    async def read(self, answers: int, spread_s: float, backlog: int, score_s: float) -> float:
        from redline.loop import ray_engines

        ray_engines.STREAM_BACKLOG = backlog
        engine = ray_engines.RayEngine(self.engine, {})

        async def scored(delay):
            answer = await engine.generate([delay])
            until = time.perf_counter() + score_s
            while time.perf_counter() < until:  # the loop is held, as by a reward function
                pass
            return answer

        began = time.perf_counter()
        await asyncio.gather(*(scored(spread_s * i / answers) for i in range(answers)))
        return time.perf_counter() - began - spread_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--answers", type=int, default=200)
    parser.add_argument("--spread-ms", type=float, default=200.0)
    parser.add_argument("--score-ms", default="0,0.5", help="the reader's time per answer, one run per value")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import ray

    args.out.mkdir(parents=True, exist_ok=True)
    environment = json.loads(write_environment(args.out).read_text())
    ray.init(include_dashboard=False, logging_level="ERROR")
    engine = ray.remote(StaggeredEngine).remote()
    reader = ray.remote(Reader).remote(engine)
    results = []
    for score_ms in [float(v) for v in args.score_ms.split(",")]:
        for name, backlog in SETTINGS.items():
            call = (args.answers, args.spread_ms / 1e3, backlog, score_ms / 1e3)
            ray.get(reader.read.remote(*call))  # warm-up
            ray.get(engine.take_chunks.remote())
            after = [ray.get(reader.read.remote(*call)) for _ in range(args.repeats)]
            results.append({"stream": name, "backlog": backlog, "score_ms": score_ms,
                            "after_last_answer_ms": [a * 1e3 for a in after],
                            "median_after_last_answer_ms": statistics.median(after) * 1e3,
                            "chunks_per_rollout": ray.get(engine.take_chunks.remote()) / args.repeats})
            print(results[-1], flush=True)
    ray.shutdown()
    summary = {"answers": args.answers, "spread_ms": args.spread_ms, "repeats": args.repeats, "results": results}
    (args.out / "ray-stream.json").write_text(json.dumps(summary, indent=1) + "\n")
    rows = [f"| {r['score_ms']} | {r['stream']} | {r['median_after_last_answer_ms']:.1f} | "
            f"{r['chunks_per_rollout']:.0f} |" for r in results]
    (args.out / "ray-stream.md").write_text(
        f"# {args.answers} answers finishing over {args.spread_ms:.0f} ms, streamed between two Ray actors\n\n"
        f"Medians of {args.repeats} rollouts; Ray {environment['software']['Ray']}, commit {environment['commit']}, "
        f"{environment['date']} (`environment.json`).\n\n"
        "| reader's ms per answer | stream | reader done after the engine's last answer (ms) | chunks per rollout |\n"
        "| ---: | --- | ---: | ---: |\n"
        + "\n".join(rows) + "\n")
    print((args.out / "ray-stream.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
