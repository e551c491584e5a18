"""benchmarks/bench_ray_rollout.py: the placements take turns, each round's differences are paired, the verdict
follows the interval, and the whole benchmark runs the loop's rollout, or its whole step, in each placement."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_ray_rollout as bench  # noqa: E402  (a script of benchmarks/, not a package)

from .test_train import small_config  # noqa: E402


def test_each_placement_takes_each_position_in_turn():
    orders = [bench.turn_order(bench.MODES, k) for k in range(4)]
    assert orders[:3] == [["in-process", "ray-rank", "ray-actor"], ["ray-rank", "ray-actor", "in-process"],
                          ["ray-actor", "in-process", "ray-rank"]]
    assert orders[3] == orders[0]


def test_the_verdict_follows_the_interval_against_2_percent():
    assert bench.verdict(-0.01, 0.019) == "meets"
    assert bench.verdict(0.021, 0.05) == "misses"
    assert bench.verdict(0.0, 0.03) == "unresolved"


def records(seconds_by_mode: dict[str, list[list[float]]]) -> list[dict]:
    """One record per rollout; the manager measured 1 ms less than the rank waited."""
    return [{"repeat": repeat, "round": k, "mode": mode, "seconds": s, "phases": {"manager": s - 0.001}}
            for mode, repeats in seconds_by_mode.items() for repeat, rounds in enumerate(repeats)
            for k, s in enumerate(rounds)]


def test_differences_are_paired_by_round_so_a_slow_round_cancels_out():
    # round 1 is slow for every placement (the host's noise); ray-actor is 1.5 ms slower in every round
    base = [[0.100, 0.200, 0.100, 0.101, 0.100], [0.100, 0.100, 0.300, 0.100, 0.100]]
    summary = bench.summarize(records({"in-process": base,
                                       "ray-actor": [[s + 0.0015 for s in r] for r in base]}),
                              ("in-process", "ray-actor"))
    actor = summary["ray-actor"]
    assert actor["paired_median_ms"] == pytest.approx(1.5)
    assert actor["paired_low_ms"] == pytest.approx(1.5) and actor["paired_high_ms"] == pytest.approx(1.5)
    assert actor["per_repeat_ms"] == pytest.approx([1.5, 1.5])
    assert actor["relative"] == pytest.approx(0.015)  # of in-process's median rollout, 100 ms
    assert actor["rest_median_ms"] == pytest.approx(1.0)  # the hop: the rank's wait beyond the manager's own
    assert actor["phase_median_ms"] == {"manager": pytest.approx(100.5)}
    assert summary["in-process"]["median_ms"] == pytest.approx(100.0)
    assert actor["verdict"] == "meets"
    table = bench.table(summary, "rollout")
    assert "| manager's own (ms) | hop (ms) |" in table
    assert "| ray-actor | 101.5 | 100.5 | 1.0 | +1.5 [+1.5, +1.5] |" in table and "| meets |" in table


def test_a_placement_slower_by_more_than_the_noise_misses():
    base = [[0.100 + 0.001 * (k % 3) for k in range(20)]]
    summary = bench.summarize(records({"in-process": base, "ray-rank": [[s + 0.010 for s in base[0]]]}),
                              ("in-process", "ray-rank"))
    assert summary["ray-rank"]["verdict"] == "misses"
    assert summary["ray-rank"]["relative_low"] > 0.02


def test_a_repeats_own_offset_widens_the_interval_as_much_as_the_repeats_differ():
    # each repeat's processes draw their own speed: ray-rank is +0, +3 and +6 ms in its three repeats, every round
    base = [[0.100] * 20] * 3
    rank = [[s + offset for s in r] for r, offset in zip(base, (0.0, 0.003, 0.006))]
    summary = bench.summarize(records({"in-process": base, "ray-rank": rank}), ("in-process", "ray-rank"))["ray-rank"]
    assert summary["per_repeat_ms"] == pytest.approx([0.0, 3.0, 6.0])
    assert summary["paired_low_ms"] == pytest.approx(0.0, abs=1e-9)
    assert summary["paired_high_ms"] == pytest.approx(6.0)
    assert summary["verdict"] == "unresolved"


@pytest.mark.parametrize("text", ["ray-rank,ray-actor", "in-process", "in-process,ray-rank,ray-rank",
                                  "in-process,ray-relay"])
def test_modes_without_the_base_or_unknown_or_twice_are_refused(text):
    with pytest.raises(Exception, match="--modes"):
        bench.parse_modes(text)


def test_the_stand_in_server_is_started_for_the_benchmark_and_stopped_after(tmp_path):
    from redline.rollout.sglang.client import SGLangClient

    async def healthy(url):
        client = SGLangClient(url)
        try:
            return await client.health()
        finally:
            await client.close()

    with bench.engine_overrides("stand-in", None, tmp_path) as overrides:
        assert overrides["rollout_engine"] == "sglang"
        assert asyncio.run(healthy(overrides["sglang_server_urls"]))
    assert not asyncio.run(healthy(overrides["sglang_server_urls"]))


def test_sglang_is_launched_and_frozen_as_the_loop_does_it_and_attached_by_url(tmp_path, monkeypatch):
    from redline.loop import rollout_setup

    class Launched:
        workers = [type("Client", (), {"url": "http://127.0.0.1:1234"})()]
        frozen = stopped = False

        async def freeze_gc(self):
            Launched.frozen = True
            return []

        async def shutdown(self):
            Launched.stopped = True

    def launch(config, log_dir):
        assert config.rollout.rollout_engine == "sglang" and log_dir == tmp_path
        return Launched()

    monkeypatch.setattr(rollout_setup, "build_sglang_engine", launch)
    with bench.engine_overrides("sglang", small_config(tmp_path), tmp_path) as overrides:
        assert overrides == {"rollout_engine": "sglang", "sglang_server_urls": "http://127.0.0.1:1234"}
        assert Launched.frozen and not Launched.stopped
    assert Launched.stopped


def step_records(phases_by_mode: dict[str, tuple[float, float, float]]) -> list[dict]:
    """Two rounds of one repeat per mode; each step 5 ms longer than its rollout, train and weight update."""
    return [{"repeat": 0, "round": k, "mode": mode, "seconds": sum(phases) + 0.005,
             "phases": dict(zip(bench.STEP_PHASES, phases))} for mode, phases in phases_by_mode.items() for k in (0, 1)]


def test_a_steps_table_shows_its_phases_and_what_they_leave():
    summary = bench.summarize(step_records({"in-process": (0.080, 0.100, 0.004), "ray-actor": (0.090, 0.100, 0.005)}),
                              ("in-process", "ray-actor"))
    assert summary["ray-actor"]["phase_median_ms"] == pytest.approx({"rollout": 90.0, "train": 100.0,
                                                                      "update_weights": 5.0})
    assert summary["ray-actor"]["rest_median_ms"] == pytest.approx(5.0)
    assert summary["ray-actor"]["paired_median_ms"] == pytest.approx(11.0)
    table = bench.table(summary, "step")
    assert "| placement | step (ms) | rollout (ms) | train (ms) | weight update (ms) | other phases (ms) |" in table
    assert "| ray-actor | 200.0 | 90.0 | 100.0 | 5.0 | 5.0 | +11.0 [+11.0, +11.0] |" in table


def test_steps_on_the_stand_in_are_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path), "--measure", "step", "--engine", "stand-in"])
    assert "--measure step pushes weights, which the stand-in cannot take" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_missing_config_is_refused_naming_it_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "out"), "--config", str(tmp_path / "missing.toml")])
    assert f"--config: config file {tmp_path / 'missing.toml'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def run_bench(out, *args):
    pytest.importorskip("ray", reason="the benchmark places the loop with Ray")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ray_rollout.py"), str(out), *args], check=True,
                   cwd=ROOT, timeout=600, capture_output=True)


def test_a_rollout_host_times_the_loops_rollout_beside_the_managers_own_time(tmp_path):
    from redline.configfile import apply_overrides
    from redline.loop.builtin import materialize

    config = small_config(tmp_path)
    host = bench.LoopHost(apply_overrides(config, materialize(config, tmp_path / "builtin")), "rollout")
    try:
        turns = [host.next_turn() for _ in range(2)]
    finally:
        host.close()
    assert all(set(phases) == {"manager"} and 0 < phases["manager"] <= seconds for seconds, phases in turns)


@pytest.mark.slow  # a Ray runtime, three placements each building the whole run
def test_the_benchmark_times_whole_steps_in_each_placement_with_their_phases(tmp_path):
    run_bench(tmp_path, "--measure", "step", "--engine", "embedded", "--rounds", "2", "--repeats", "1")
    result = json.loads((tmp_path / "ray-step.json").read_text())
    steps = result["records"]
    assert result["measure"] == "step"
    assert [r["mode"] for r in steps] == bench.turn_order(bench.MODES, 0) + bench.turn_order(bench.MODES, 1)
    for step in steps:
        assert set(step["phases"]) == set(bench.STEP_PHASES)
        assert 0 < sum(step["phases"].values()) <= step["seconds"]
    assert set(result["summary"]) == set(bench.MODES)
    assert {s["verdict"] for m, s in result["summary"].items() if m != "in-process"} <= \
        {"meets", "misses", "unresolved"}
    assert "| ray-actor |" in (tmp_path / "ray-step.md").read_text()
    assert json.loads((tmp_path / "environment.json").read_text())["software"]
