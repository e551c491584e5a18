"""Colocated engine seats under TP × PP × DP: each seat is whole model-parallel groups and every engine is used.

The 8-process layout (TP=2 × PP=2 × DP=2) is built for real, one rank at a time, over torch's in-process fake
process group (no communication: the mesh, its groups and each rank's coordinates are what ``ParallelConfig.build``
and ``model_parallel_group`` make of them)."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from redline.loop.data_parallel import DataParallel, model_parallel_group
from redline.loop.engine_placement import colocated_seat
from redline.loop.model_parallel import lm_head_leader
from redline.trainer.models.spec import ModelSpec
from redline.trainer.parallel import ParallelConfig
from redline.trainer.parallel.stages import head_cost_layers, stage_sizes


def ranks_of(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def build_every_rank(config: ParallelConfig) -> dict[int, dict]:
    """Per global rank: its coordinates, groups and pipeline peers as the real mesh builds them."""
    world, seen = config.dp * config.pp * config.tp, {}
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            state = config.build("cpu")
            mp_group = model_parallel_group(state)
            dp = DataParallel(rank=state.dp_rank, world=config.dp, state=state, mp_group=mp_group)
            seen[rank] = {"coords": (state.dp_rank, state.pp_rank, state.tp_rank), "mp": ranks_of(mp_group),
                          "tp": ranks_of(state.tp_group), "pp": ranks_of(state.pp_group),
                          "dp": ranks_of(state.dp_group), "holds_engine": dp.holds_engine,
                          "next_stage": state.pp_peer(1) if state.pp_rank + 1 < state.pp else None,
                          "lm_head_leader": lm_head_leader(type("M", (), {"pp_state": state})())}
        finally:
            dist.destroy_process_group()
    return seen


@pytest.fixture(scope="module")
def tp2_pp2_dp2():
    return build_every_rank(ParallelConfig(tp=2, pp=2, dp=2))


def test_rank_order_is_dp_outermost(tp2_pp2_dp2):
    """rank = dp·(PP·TP) + pp·TP + tp: a model-parallel group is a block of consecutive ranks, stage-major."""
    config = ParallelConfig(tp=2, pp=2, dp=2)
    for rank, seen in tp2_pp2_dp2.items():
        dp_rank, pp_rank, tp_rank = seen["coords"]
        assert config.global_rank(dp_rank, pp_rank, tp_rank) == rank
        assert seen["mp"] == list(range(4 * dp_rank, 4 * dp_rank + 4))
        assert seen["tp"] == [4 * dp_rank + 2 * pp_rank, 4 * dp_rank + 2 * pp_rank + 1]
        assert seen["pp"] == [4 * dp_rank + tp_rank, 4 * dp_rank + 2 + tp_rank]  # send/recv peers: same dp, tp
        assert seen["dp"] == [2 * pp_rank + tp_rank, 4 + 2 * pp_rank + tp_rank]
        assert seen["next_stage"] == (rank + 2 if pp_rank == 0 else None)
        assert seen["lm_head_leader"] == 2  # DP 0, TP 0 of the last stage
    assert [r for r, s in tp2_pp2_dp2.items() if s["holds_engine"]] == [0, 4]  # the DP leaders


def test_seats_of_four_gpus_are_the_model_parallel_groups(tp2_pp2_dp2):
    """--rollout-num-gpus-per-engine 4: engine e sits on DP rank e's group, led by that group's leader, and is
    the engine DP rank e's leader generates on; both engines are used."""
    seats = {rank: colocated_seat(rank, 8, 4) for rank in range(8)}
    assert {s.engine: s.ranks for s in seats.values()} == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    for rank, seat in seats.items():
        assert seat.ranks == tuple(tp2_pp2_dp2[rank]["mp"])  # exactly this rank's model-parallel group
        assert seat.leader == seat.ranks[0] and tp2_pp2_dp2[seat.leader]["holds_engine"]
        assert seat.engine_rank == rank - 4 * seat.engine  # engine TP rank i on the GPU of rank e·4 + i
    users = {tp2_pp2_dp2[r]["coords"][0]: seats[r].engine for r in range(8) if tp2_pp2_dp2[r]["holds_engine"]}
    assert users == {0: 0, 1: 1}  # DP rank -> the engine its leader generates on


def test_seat_of_eight_gpus_spans_both_groups(tp2_pp2_dp2):
    """--rollout-num-gpus-per-engine 8: one engine on both whole groups, launched by DP 0's leader; DP 1's leader
    (rank 4) generates on it too."""
    seats = {rank: colocated_seat(rank, 8, 8) for rank in range(8)}
    assert {s.ranks for s in seats.values()} == {tuple(range(8))}
    leaders = [r for r in range(8) if tp2_pp2_dp2[r]["holds_engine"]]
    assert leaders == [0, 4] and {seats[r].engine for r in leaders} == {0}
    assert seats[0].is_leader and not seats[4].is_leader


def test_two_seats_per_group_are_not_whole_groups():
    """A seat smaller than a group (here 2 GPUs under TP × PP = 4) would split a group: refused at start-up
    (``check_engine_gpus``), and the arithmetic shows why: rank 2 (stage 1 of DP 0) leads a seat."""
    config = ParallelConfig(tp=2, pp=2, dp=2)
    assert colocated_seat(config.global_rank(0, 1, 0), 8, 2).is_leader


def test_global_rank_checks_coordinates():
    with pytest.raises(ValueError, match="pp coordinate 2 outside 0..1"):
        ParallelConfig(tp=2, pp=2, dp=2).global_rank(0, 2, 0)


def test_checkpoint_of_the_older_rank_order_is_refused(tmp_path):
    """A DP × PP checkpoint records its rank order; one from before DP went outermost (none recorded) is refused
    at start-up, since its ``rank<r>`` states belong to other mesh coordinates now."""
    from redline.configfile import ConfigError
    from redline.loop import state_file
    from redline.loop.checkpoint import RANK_ORDER, saved_rank_order
    from redline.loop.validate import check_load

    layout = {"dp": 2, "tp": 1, "pp": 2}
    folder = tmp_path / "rollout_3"
    folder.mkdir()
    (tmp_path / "latest").write_text("rollout_3")
    state_file.save(folder / "state", {"rollout_id": 3, "layout": layout})
    assert saved_rank_order(folder) == "pp,dp,tp"
    with pytest.raises(ConfigError, match=r"ranks ordered pp,dp,tp .*redline now orders them dp,pp,tp"):
        check_load(tmp_path, layout)
    state_file.save(folder / "state", {"rollout_id": 3, "layout": layout, "rank_order": RANK_ORDER})
    check_load(tmp_path, layout)
    state_file.save(folder / "state", {"rollout_id": 3, "layout": {"dp": 2, "tp": 2, "pp": 1}})
    check_load(tmp_path, {"dp": 2, "tp": 2, "pp": 1})  # without PP both orders are the same


class _GatheredModel:
    spec = ModelSpec(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=5, num_heads=4,
                     num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False, mlp_bias=False,
                     qk_norm=True, tie_word_embeddings=True)

    def save_pretrained(self, folder, write):
        if write:
            folder.mkdir(parents=True)


def test_checkpoint_saved_at_dp_times_pp_records_its_rank_order(tmp_path):
    """Rank 0 of DP=2 × PP=2 (fake process group: the barriers pass at once) writes ``rank_order`` and the stages'
    layers beside the layout, and ``check_load`` takes the folder back at that layout."""
    from redline.loop import checkpoint
    from redline.loop.validate import check_load

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        state = ParallelConfig(pp=2, dp=2).build("cpu")
        dp = DataParallel(rank=state.dp_rank, world=2, state=state, mp_group=model_parallel_group(state))
        folder = checkpoint.save(tmp_path, 3, _GatheredModel(), tmp_path, {}, {}, dp)
    finally:
        dist.destroy_process_group()
    assert checkpoint.saved_rank_order(folder) == "dp,pp,tp" == checkpoint.RANK_ORDER
    stages = stage_sizes(5, 2, head_layers=head_cost_layers(_GatheredModel.spec))
    assert checkpoint.saved_layout(folder) == {"dp": 2, "tp": 1, "pp": 2, "stages": stages}
    check_load(tmp_path, {"dp": 2, "tp": 1, "pp": 2, "stages": stages})
