"""Checkpoint state files: exact round trips without pickle, and folders that would unpickle are refused."""

import pickle
import random

import numpy as np
import pytest
import torch

from redline.loop import checkpoint, state_file


def assert_same(a, b, where="state"):
    """Equal values of equal types all the way down (tensors: dtype, shape and bits)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert type(key) is type(next(k for k in b if k == key)), (where, key)
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where


def trained_optimizer_state() -> tuple[dict, dict]:
    """A real AdamW state_dict (int param ids as keys, 0-dim step tensors) and LambdaLR state after two steps."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    return optimizer.state_dict(), scheduler.state_dict()


def test_real_optimizer_scheduler_and_rng_states_round_trip_exactly(tmp_path):
    optimizer, scheduler = trained_optimizer_state()
    assert all(isinstance(k, int) for k in optimizer["state"])  # the case plain JSON would break
    state = {"worker": {"optimizer": optimizer, "scheduler": scheduler, "bad_steps": 0}, "kl_controller": None,
             "rollout_id": 9, "rng": checkpoint.rng_state(),
             "odd": {"bf16": torch.randn(3, 2).to(torch.bfloat16), "scalar": torch.tensor(7, dtype=torch.int64),
                     "empty": torch.zeros(0, 4), "mixed": {1: "a", "1": "b", (2, 3): [1.5, float("inf")]},
                     "flags": (True, False, None), "nan": float("nan"), "np": np.float64(0.25)}}
    state_file.save(tmp_path / "state", state)
    assert_same(state, state_file.load(tmp_path / "state"))


def test_loaded_optimizer_state_resumes_the_same_updates(tmp_path):
    """The round-tripped state drives AdamW exactly like the original."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state_file.save(tmp_path / "opt", optimizer.state_dict())
    twin = torch.nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_optimizer.load_state_dict(state_file.load(tmp_path / "opt"))
    x = torch.randn(3, 4)
    for m, opt in ((model, optimizer), (twin, twin_optimizer)):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)


def test_restored_rng_states_replay_the_same_draws(tmp_path):
    state_file.save(tmp_path / "rng", checkpoint.rng_state())
    first = (random.random(), np.random.rand(), torch.rand(2))
    checkpoint.set_rng_state(state_file.load(tmp_path / "rng"))
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_unsupported_values_are_refused_where_they_sit(tmp_path):
    with pytest.raises(TypeError, match=r"state\['worker'\]\['fn'\]: cannot store a set"):
        state_file.save(tmp_path / "bad", {"worker": {"fn": {1, 2}}})


class Detonator:
    """Unpickling this creates the file ``path``: proof that something was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_in_a_checkpoint_folder_is_never_unpickled(tmp_path):
    proof = tmp_path / "unpickled"
    folder = tmp_path / "checkpoints" / "rollout_3"
    folder.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("rollout_3")
    for name in ("state.pt", "rank0.pt"):
        torch.save({"payload": Detonator(proof)}, folder / name)
    with pytest.raises(ValueError, match=r"older pickle format \(state.pt\).*no longer loads"):
        checkpoint.resolve(tmp_path)
    # a pickle dropped beside (or in place of) the new files is not read either
    checkpoint.save(tmp_path / "ok", 0, _NoModel(), tmp_path, {"rollout_id": 0}, {"rollout": {}})
    saved = tmp_path / "ok" / "rollout_0"
    (saved / "state.safetensors").write_bytes(pickle.dumps(Detonator(proof)))
    with pytest.raises(Exception):
        checkpoint.load_state(saved)
    assert not proof.exists()


class _NoModel:
    def save_pretrained(self, folder):
        folder.mkdir(parents=True)


def test_checkpoint_save_and_load_state(tmp_path):
    optimizer, scheduler = trained_optimizer_state()
    shared = {"worker": {"optimizer": optimizer, "scheduler": scheduler, "bad_steps": 1}, "critic": None}
    folder = checkpoint.save(tmp_path, 4, _NoModel(), tmp_path, shared, {"rollout": {"epoch": 2, "order": [3, 1]}})
    assert checkpoint.resolve(tmp_path) == folder and checkpoint.saved_rollout(folder) == 4
    loaded, mine = checkpoint.load_state(folder)
    assert_same({**shared, "rollout_id": 4, "layout": {"dp": 1, "tp": 1, "pp": 1}}, loaded)
    assert checkpoint.saved_layout(folder) == {"dp": 1, "tp": 1, "pp": 1}
    assert mine["rollout"] == {"epoch": 2, "order": [3, 1]} and set(mine["rng"]) >= {"python", "numpy", "torch"}
