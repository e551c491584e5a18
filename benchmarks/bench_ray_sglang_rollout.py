"""What Ray adds to a rollout on SGLang servers, with the server's own time taken out of the comparison: the
quickstart's rollout (25 prompts x 8 samples, one /generate call each) against the stand-in SGLang server
(``tests/rollout/fake_sglang.py``, in a process of its own; it answers at once), timed three ways:

* ``in-process``: the ``RolloutManager`` in the calling process, as without Ray (the objects alive before the
  timed rollouts frozen, as the loop freezes them: ``redline.long_lived``);
* ``ray-relay``: the manager in the rollout manager actor, every engine call relayed through a trainer rank's actor
  (``TrainerRank.call`` / ``generate_each``): what the actor does with an engine it cannot reach itself;
* ``ray-direct``: the manager in the actor as the servers' own HTTP client (``SGLangEngine.endpoints``), what
  ``redline train --ray-address`` does with SGLang servers.

    python3 benchmarks/bench_ray_sglang_rollout.py OUT [--rollouts 10] [--repeats 3]

The modes alternate, ``--rollouts`` timed rollouts each after one untimed, ``--repeats`` times. Writes
``OUT/ray-sglang-rollout.json`` (every rollout's seconds, the environment) and ``OUT/ray-sglang-rollout.md``.
Needs Ray and aiohttp; no GPU (redline train refuses SGLang without CUDA, so this drives the pieces itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("in-process", "ray-relay", "ray-direct")


class OfferedAsAnyEngine:
    """An SGLang client offered to the manager without its endpoints: the actor relays its calls through the rank."""

    def __init__(self, engine):
        self.inner = engine

    def __getattr__(self, name):
        if name == "endpoints":
            raise AttributeError(name)
        return getattr(self.inner, name)


def timed_rollouts(manager, rollouts: int) -> list[float]:
    """Seconds of each of ``rollouts`` rollouts of ``manager`` after an untimed one, on an event loop of this
    thread (as the training thread of a rank runs them)."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(manager.generate_rollout())
        times = []
        for _ in range(rollouts):
            start = time.perf_counter()
            loop.run_until_complete(manager.generate_rollout())
            times.append(time.perf_counter() - start)
        loop.run_until_complete(manager.close())
        return times
    finally:
        loop.close()


def in_process(config, url: str, rollouts: int) -> list[float]:
    from transformers import AutoTokenizer

    from redline.long_lived import long_lived_frozen
    from redline.loop.rollout_setup import build_manager, run_reward
    from redline.rollout.sglang.engine import SGLangEngine

    tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    engine = SGLangEngine([url])
    manager = build_manager(config, tokenizer, engine, run_reward(config))
    try:
        with long_lived_frozen():  # as the loop runs its steps (redline.long_lived; REDLINE_GC_FREEZE=0 opts out)
            return timed_rollouts(manager, rollouts)
    finally:
        asyncio.run(engine.shutdown())


def on_ray(config, url: str, rollouts: int, direct: bool, name: str) -> list[float]:
    import ray

    from redline.loop.ray_launch import TrainerRank
    from redline.loop.ray_rollout import MANAGER_ENV

    class Rank(TrainerRank):
        async def rollouts(self) -> list[float]:
            return await asyncio.to_thread(self._rollouts)

        def _rollouts(self) -> list[float]:
            from redline.loop.data_parallel import SINGLE_PROCESS
            from redline.loop.ray_rollout import remote_manager
            from redline.rollout.sglang.engine import SGLangEngine

            manager = remote_manager(config, SINGLE_PROCESS)
            engine = SGLangEngine([url])
            manager.engine = engine if direct else OfferedAsAnyEngine(engine)
            try:
                return timed_rollouts(manager, rollouts)
            finally:
                asyncio.run(engine.shutdown())

    rank = ray.remote(Rank).remote({MANAGER_ENV: name})
    try:
        return ray.get(rank.rollouts.remote(), timeout=600)
    finally:
        ray.kill(rank)
        ray.kill(ray.get_actor(name))


def table(medians: dict[str, list[float]]) -> str:
    base = statistics.median(medians["in-process"])
    rows = ["| mode | median rollout ms per repeat | median | vs in-process |", "| --- | --- | ---: | ---: |"]
    for mode in MODES:
        per_repeat = ", ".join(f"{1e3 * m:.1f}" for m in medians[mode])
        median = statistics.median(medians[mode])
        rows.append(f"| {mode} | {per_repeat} | {1e3 * median:.1f} | {1e3 * (median - base):+.1f} ms |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rollouts", type=int, default=10, help="timed rollouts per mode and repeat")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three modes")
    args = ap.parse_args(argv)
    if args.rollouts < 1 or args.repeats < 1:
        ap.error("--rollouts and --repeats must be at least 1")
    sys.path.insert(0, str(ROOT))  # the stand-in server lives with the tests
    import ray

    from redline.configfile import apply_overrides, load_toml
    from redline.config import RunConfig
    from redline.env_report import software, source_revision
    from redline.loop.builtin import materialize
    from redline.loop.ray_launch import local_runtime
    from tests.rollout.fake_sglang import fake_sglang_process

    args.out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch, fake_sglang_process() as url:
        config = load_toml(RunConfig, ROOT / "examples" / "quickstart.toml")
        config = apply_overrides(config, {"output_dir": scratch, "rollout_engine": "sglang",
                                          "sglang_server_urls": url})
        config = apply_overrides(config, materialize(config, Path(scratch) / "builtin"))
        ray.init(include_dashboard=False, logging_level="WARNING", **local_runtime(config))  # as --ray-address local
        try:
            for repeat in range(args.repeats):
                for mode in MODES:
                    if mode == "in-process":
                        times = in_process(config, url, args.rollouts)
                    else:
                        times = on_ray(config, url, args.rollouts, mode == "ray-direct", f"bench-{mode}-{repeat}")
                    seconds[mode].append(times)
                    print(f"repeat {repeat} {mode}: median {1e3 * statistics.median(times):.1f} ms", flush=True)
        finally:
            ray.shutdown()
    medians = {mode: [statistics.median(t) for t in runs] for mode, runs in seconds.items()}
    result = {"rollouts": args.rollouts, "repeats": args.repeats, "samples_per_rollout": 25 * 8,
              "seconds": seconds, "median_s": {m: statistics.median(v) for m, v in medians.items()},
              "software": software(), "commit": source_revision(), "date": time.strftime("%Y-%m-%d")}
    (args.out / "ray-sglang-rollout.json").write_text(json.dumps(result, indent=2))
    text = (f"# Ray's cost on a rollout against the stand-in SGLang server ({result['date']}, {result['commit']})\n\n"
            f"{args.rollouts} timed rollouts of 200 requests per mode and repeat, modes alternating.\n\n"
            f"{table(medians)}\n")
    (args.out / "ray-sglang-rollout.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
