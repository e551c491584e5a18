"""What Ray adds to the loop's rollout, or to its whole RL step, with the host's noise paired out.

Whole-run pairs could not resolve issue 18's 2 % on a shared or virtualised host: runs of the same code differed by
up to 45 %, because each process draws its own host speed. Here every placement of the loop lives in a process that
stays up for a whole repeat, built as ``redline train`` builds it, and the placements take turns, one rollout or
step each, so each round's differences are drawn under the same load:

* ``in-process``: a plain process, as ``redline train`` without Ray;
* ``ray-rank``: a ``TrainerRank`` actor building its manager itself (``--rollout-manager rank``);
* ``ray-actor``: a ``TrainerRank`` actor whose batches come from the rollout manager actor (the default): the actor
  calls SGLang servers itself, and relays every other engine's calls through the rank.

``--measure rollout`` builds the rollout alone (``build_rollout``: the engine and the ``RolloutManager`` or, under
Ray, this rank's shard of the rollout manager actor) and times ``generate``; ``--measure step`` builds the whole
run (``build``: trainer, engine, rollout, weight sync) and times ``rl_step``, what issue 18's target is about.

Engines (``--engine``): ``stand-in`` (``tests/rollout/fake_sglang.py`` in its own process, answering at once; no
GPU; rollouts only: a push needs SGLang's CUDA-IPC serializer), ``sglang`` (one server launched here, as the loop
launches it, attached by every placement; in step mode each placement pushes its weights to it in its turn),
``embedded`` (each placement's own engine in its process, as the loop's default).

    python3 benchmarks/bench_ray_rollout.py OUT [--measure rollout] [--engine stand-in]
        [--modes in-process,ray-rank,ray-actor] [--rounds 30] [--repeats 3] [--config examples/quickstart.toml]

Each placement makes two untimed rollouts or steps first. Writes ``OUT/ray-<measure>.json`` (every turn: the
seconds, its phases, the turn order; the summary), ``OUT/ray-<measure>.md`` and ``OUT/environment.json``. Needs
Ray (and aiohttp for SGLang).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("in-process", "ray-rank", "ray-actor")
ENGINES = ("stand-in", "sglang", "embedded")
BASE = "in-process"
TARGET = 0.02  # issue 18: Ray adds at most 2 % (to the step; here also to the rollout)
WARM_TURNS = 2
RESAMPLES = 2000
MEASURES = ("rollout", "step")
STEP_PHASES = ("rollout", "train", "update_weights")  # rl_step's perf/<phase>_time


class LoopHost:
    """The loop as ``redline train`` builds it in this process: its rollout alone (``measure`` "rollout") or the
    whole run (``"step"``); ``next_turn()`` runs the next rollout or RL step."""

    def __init__(self, config, measure: str):
        from redline.long_lived import freeze_long_lived

        self.turn, self.state = 0, None
        if measure == "step":
            from rich.console import Console

            from redline.loop.step import rl_step
            from redline.loop.train import build

            self.state, _ = build(config, Console(quiet=True))
            self.rl_step = rl_step
        else:
            from transformers import AutoTokenizer

            from redline.loop.rollout_setup import build_rollout, trainer_device
            from redline.loop.train import DTYPES

            tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.engine, self.rollout = build_rollout(config, tokenizer, device=trainer_device(config),
                                                      dtype=DTYPES[config.model.dtype])
        freeze_long_lived()  # as the loop does before its first step

    def next_turn(self) -> tuple[float, dict[str, float]]:
        """``(wall seconds, phases in seconds)`` of the next rollout (phases: ``manager``, the manager's own
        ``perf/rollout_time``) or RL step (phases: ``STEP_PHASES`` from the step's ``perf/*``)."""
        start = time.perf_counter()
        if self.state is None:
            _, metrics = self.loop.run_until_complete(self.rollout.generate(self.turn))
            phases = {"manager": metrics["perf/rollout_time"]}
        else:
            metrics = self.rl_step(self.state, self.turn)
            phases = {phase: metrics[f"perf/{phase}_time"] for phase in STEP_PHASES}
        seconds = time.perf_counter() - start
        self.turn += 1
        return seconds, phases

    def close(self) -> None:
        if self.state is not None:
            from redline.loop.train import shutdown

            shutdown(self.state)
            return
        self.loop.run_until_complete(self.rollout.close())
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


def serve_host(conn, config, measure: str) -> None:
    """A plain process's host: builds it, then answers "turn" with ``next_turn()`` until "close"."""
    host = LoopHost(config, measure)
    conn.send("ready")
    while conn.recv() == "turn":
        conn.send(host.next_turn())
    host.close()
    conn.send("closed")


class ProcessHost:
    """``LoopHost`` in a spawned process of its own (``in-process``)."""

    def __init__(self, config, measure: str):
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=serve_host, args=(theirs, config, measure), daemon=True)
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("the in-process host did not start")

    def next_turn(self) -> tuple[float, dict[str, float]]:
        self.conn.send("turn")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("close")
        self.conn.recv()
        self.process.join(timeout=60)


def rank_actor_class():
    """``TrainerRank`` with a ``LoopHost`` built and driven in one thread of its own, as a rank's training thread
    runs the loop while the actor's event loop answers the rollout manager actor."""
    from redline.loop.ray_launch import TrainerRank

    class LoopRank(TrainerRank):
        def __init__(self, env: dict[str, str]):
            super().__init__(env)
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="training")
            self.host = None

        async def _in_thread(self, fn, *args):
            return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

        async def build(self, config, measure: str) -> None:
            self.host = await self._in_thread(LoopHost, config, measure)

        async def next_turn(self) -> tuple[float, dict[str, float]]:
            return await self._in_thread(self.host.next_turn)

        async def close(self) -> None:
            await self._in_thread(self.host.close)

    return LoopRank


class RayHost:
    """``LoopHost`` in a ``TrainerRank`` actor, with the rollout manager actor ``manager`` (None: the rank's own
    manager). The rank gets the torch threads a lone rank's bundle gives it (all this process's CPUs)."""

    def __init__(self, config, measure: str, manager: str | None):
        import ray

        from redline.loop.ray_engines import threads_env
        from redline.loop.ray_launch import usable_cpus
        from redline.loop.ray_rollout import MANAGER_ENV

        self.ray, self.manager = ray, manager
        gpus = 0.01 if ray.cluster_resources().get("GPU") else 0  # a share: CUDA visible, the placements side by side
        self.actor = ray.remote(rank_actor_class()).options(
            num_cpus=0, num_gpus=gpus, runtime_env=threads_env(usable_cpus())).remote(
            {MANAGER_ENV: manager} if manager else {})
        ray.get(self.actor.build.remote(config, measure))

    def next_turn(self) -> tuple[float, dict[str, float]]:
        return tuple(self.ray.get(self.actor.next_turn.remote()))

    def close(self) -> None:
        self.ray.get(self.actor.close.remote())
        self.ray.kill(self.actor)
        if self.manager:
            self.ray.kill(self.ray.get_actor(self.manager))


def start_host(mode: str, config, measure: str, repeat: int):
    if mode == "in-process":
        return ProcessHost(config, measure)
    return RayHost(config, measure, f"bench-rollout-manager-{repeat}" if mode == "ray-actor" else None)


def turn_order(modes: tuple[str, ...], round_index: int) -> list[str]:
    """The modes rotated by ``round_index``: each takes each position in turn, so none always runs first."""
    shift = round_index % len(modes)
    return list(modes[shift:] + modes[:shift])


def bootstrap_median(by_repeat: list[list[float]], seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median of the pooled values, resampled in two stages: the repeats
    with replacement, then each drawn repeat's values. A repeat's processes keep their own host speed for all its
    rounds, so its rounds are not independent draws; resampling rounds alone would understate the spread."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(v for values in draw.choices(by_repeat, k=len(by_repeat))
                                       for v in draw.choices(values, k=len(values))) for _ in range(RESAMPLES))
    return medians[int(0.025 * RESAMPLES)], medians[int(0.975 * RESAMPLES) - 1]


def verdict(low: float, high: float, target: float = TARGET) -> str:
    """Whether a relative overhead with 95 % interval ``[low, high]`` meets ``target``, misses it, or cannot say."""
    if high <= target:
        return "meets"
    if low > target:
        return "misses"
    return "unresolved"


def summarize(records: list[dict], modes: tuple[str, ...]) -> dict:
    """Per mode: the median turn (ms), each phase's median (ms) and the median of the rest (a rollout's hop: the
    rank's wait beyond the manager's own time); against ``in-process``, the round-paired differences (ms): their
    median over every round of every repeat, each repeat's median, the median relative to in-process's median turn
    with a two-stage bootstrap 95 % interval (``bootstrap_median``), and the verdict against ``TARGET``.
    ``records``: one per turn, ``{"repeat", "round", "mode", "seconds", "phases": {phase: seconds}}``."""
    by_turn = {(r["repeat"], r["round"], r["mode"]): r for r in records}
    summary = {}
    base = statistics.median(r["seconds"] for r in records if r["mode"] == BASE)
    for mode in modes:
        own = [r for r in records if r["mode"] == mode]
        row = {"median_ms": 1e3 * statistics.median(r["seconds"] for r in own),
               "phase_median_ms": {phase: 1e3 * statistics.median(r["phases"][phase] for r in own)
                                   for phase in own[0]["phases"]},
               "rest_median_ms": 1e3 * statistics.median(r["seconds"] - sum(r["phases"].values()) for r in own)}
        if mode != BASE:
            pairs = [(r["repeat"], 1e3 * (r["seconds"] - by_turn[r["repeat"], r["round"], BASE]["seconds"]))
                     for r in own if (r["repeat"], r["round"], BASE) in by_turn]
            diffs = [d for _, d in pairs]
            repeats = sorted({rep for rep, _ in pairs})
            by_repeat = [[d for rep, d in pairs if rep == k] for k in repeats]
            low, high = bootstrap_median(by_repeat)
            relative = (low / (1e3 * base), high / (1e3 * base))
            row.update(paired_median_ms=statistics.median(diffs), paired_low_ms=low, paired_high_ms=high,
                       relative=statistics.median(diffs) / (1e3 * base), relative_low=relative[0],
                       relative_high=relative[1], verdict=verdict(*relative),
                       per_repeat_ms=[statistics.median(values) for values in by_repeat])
        summary[mode] = row
    return summary


PHASE_COLUMNS = {"manager": "manager's own", "rollout": "rollout", "train": "train",
                 "update_weights": "weight update"}


def table(summary: dict, measure: str) -> str:
    phases = list(next(iter(summary.values()))["phase_median_ms"])
    rest = "hop" if measure == "rollout" else "other phases"
    rows = [f"| placement | {measure} (ms) | " + " | ".join(f"{PHASE_COLUMNS[p]} (ms)" for p in phases)
            + f" | {rest} (ms) | paired vs in-process (ms), 95 % | each repeat (ms) | relative, 95 % | ≤ 2 % |",
            "| --- | ---: | " + "---: | " * len(phases) + "---: | ---: | --- | ---: | --- |"]
    for mode, s in summary.items():
        cells = [f"{s['median_ms']:.1f}", *(f"{s['phase_median_ms'][p]:.1f}" for p in phases),
                 f"{s['rest_median_ms']:.1f}"]
        if mode == BASE:
            cells += ["", "", "", ""]
        else:
            cells += [f"{s['paired_median_ms']:+.1f} [{s['paired_low_ms']:+.1f}, {s['paired_high_ms']:+.1f}]",
                      ", ".join(f"{d:+.1f}" for d in s["per_repeat_ms"]),
                      f"{100 * s['relative']:+.1f} % [{100 * s['relative_low']:+.1f}, {100 * s['relative_high']:+.1f}]",
                      s["verdict"]]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


@contextlib.contextmanager
def engine_overrides(engine: str, config, log_dir: Path):
    """The config overrides that point every placement at ``engine``: for the two servers, one started here for
    the whole benchmark (the stand-in in its own process; SGLang launched as the loop launches it, and asked to
    freeze its start-up's objects as the loop asks it)."""
    if engine == "embedded":
        yield {"rollout_engine": "embedded"}
        return
    if engine == "stand-in":
        sys.path.insert(0, str(ROOT))  # the stand-in lives with the tests
        from tests.rollout.fake_sglang import fake_sglang_process

        with fake_sglang_process() as url:
            yield {"rollout_engine": "sglang", "sglang_server_urls": url}
        return
    from redline.configfile import apply_overrides
    from redline.long_lived import freeze_engine_servers
    from redline.loop.rollout_setup import build_sglang_engine

    launching = apply_overrides(config, {"rollout_engine": "sglang"})  # its memory share and graphs as the loop's
    server, loop = build_sglang_engine(launching, log_dir=log_dir), asyncio.new_event_loop()
    try:
        for url in freeze_engine_servers(server, loop):  # as the loop asks before its first step
            print(f"SGLang server {url} has no /freeze_gc", flush=True)
        yield {"rollout_engine": "sglang", "sglang_server_urls": server.workers[0].url}
    finally:
        loop.run_until_complete(server.shutdown())
        loop.close()


def measure(config, what: str, modes: tuple[str, ...], rounds: int, repeats: int) -> list[dict]:
    """Every timed turn (rollout or step, ``what``) of every placement, the placements taking turns
    (``turn_order``)."""
    records = []
    for repeat in range(repeats):
        hosts = {mode: start_host(mode, config, what, repeat) for mode in modes}
        try:
            for _ in range(WARM_TURNS):
                for host in hosts.values():
                    host.next_turn()
            for round_index in range(rounds):
                for position, mode in enumerate(turn_order(modes, round_index)):
                    seconds, phases = hosts[mode].next_turn()
                    records.append({"repeat": repeat, "round": round_index, "position": position, "mode": mode,
                                    "seconds": seconds, "phases": phases})
        finally:
            for host in hosts.values():
                host.close()
        done = [r for r in records if r["repeat"] == repeat]
        print(f"repeat {repeat}: " + ", ".join(
            f"{m} {1e3 * statistics.median(r['seconds'] for r in done if r['mode'] == m):.1f} ms" for m in modes),
            flush=True)
    return records


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or BASE not in modes or len(set(modes)) != len(modes) or len(modes) < 2:
        raise argparse.ArgumentTypeError(f"--modes: {text!r}; give {BASE} and at least one of "
                                         f"{', '.join(MODES[1:])}, each once")
    return modes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--measure", choices=MEASURES, default="rollout", help="what each turn times")
    ap.add_argument("--engine", choices=ENGINES, default="stand-in")
    ap.add_argument("--modes", type=parse_modes, default=MODES, help="comma-separated; in-process is the base")
    ap.add_argument("--rounds", type=int, default=30, help="timed turns per placement and repeat")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes for every placement each repeat")
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")
    if args.measure == "step" and args.engine == "stand-in":
        ap.error("--measure step pushes weights, which the stand-in cannot take (SGLang's CUDA-IPC serializer): "
                 "use --engine embedded, or sglang on a GPU")
    from redline.config import RunConfig
    from redline.configfile import ConfigError, apply_overrides, load_toml

    try:
        config = load_toml(RunConfig, args.config)
    except ConfigError as error:  # before anything is written to OUT
        ap.error(f"--config: {error}")
    import ray

    from redline.env_report import write_environment
    from redline.loop.builtin import materialize
    from redline.loop.ray_launch import local_runtime

    args.out.mkdir(parents=True, exist_ok=True)
    write_environment(args.out)
    with tempfile.TemporaryDirectory() as scratch:
        config = apply_overrides(config, {"output_dir": scratch})
        config = apply_overrides(config, materialize(config, Path(scratch) / "builtin"))
        with engine_overrides(args.engine, config, args.out / "engine-logs") as overrides:
            config = apply_overrides(config, overrides)
            ray.init(include_dashboard=False, logging_level="WARNING", **local_runtime(config))  # as local
            try:
                records = measure(config, args.measure, args.modes, args.rounds, args.repeats)
            finally:
                ray.shutdown()
    summary = summarize(records, args.modes)
    date = time.strftime("%Y-%m-%d")
    result = {"measure": args.measure, "engine": args.engine, "config": str(args.config), "rounds": args.rounds,
              "repeats": args.repeats, "modes": list(args.modes), "summary": summary, "records": records,
              "date": date}
    (args.out / f"ray-{args.measure}.json").write_text(json.dumps(result, indent=1))
    rest = ("Hop: the rank's wait for its batch minus the manager's own `perf/rollout_time`." if args.measure ==
            "rollout" else "Phases: the step's `perf/*`; other: log-probs, idle and what no phase counts.")
    text = (f"# What Ray adds to the loop's {args.measure} ({args.engine} engine, {date})\n\n"
            f"`{args.config.name}`; {args.repeats} repeats of fresh processes, {args.rounds} rounds each, the "
            f"placements taking turns one {args.measure} each (order rotated per round). Paired: each round's "
            f"{args.measure} minus in-process's of the same round; medians, 95 % intervals of a bootstrap over "
            f"repeats, then rounds. {rest}\n\n{table(summary, args.measure)}\n")
    (args.out / f"ray-{args.measure}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
