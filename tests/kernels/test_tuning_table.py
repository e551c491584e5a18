"""The persisted autotuner choices (``redline.kernels.tuning_table``): keying by fingerprint, where the table
lives, round trips through the file and back into a ``triton.autotune`` kernel."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from redline.kernels import tuning_table
from redline.kernels.tuning_table import Fingerprint

H100 = Fingerprint(device="NVIDIA H100 80GB HBM3", capability=(9, 0), driver="570.124.06", cuda="13.0",
                   triton="3.6.0", torch="2.11.0+cu130", redline="0.1.0")


def _block_hook(nargs):  # stands for the LM-head GEMMs' descriptor hook: configs with one are what Triton won't cache
    pass


TIMED = []  # one entry per config the toy autotuner times


def _bench(call, quantiles):
    """Triton's benchmarker stand-in (the interpreter has no GPU timer): runs the config, rates each later one
    faster, so the second config wins."""
    call()
    TIMED.append(1)
    return [1.0 / len(TIMED)] * len(quantiles)


@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1, pre_hook=_block_hook),
                          triton.Config({"BLOCK": 32}, num_warps=2, pre_hook=_block_hook)], key=["n_key"],
                 do_bench=_bench)
@triton.jit
def _toy_kernel(x_ptr, n, n_key, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.fixture
def toy():
    _toy_kernel.cache.clear()
    yield {"toy": _toy_kernel}
    _toy_kernel.cache.clear()


def test_equal_fingerprints_share_a_key_and_every_field_changes_it():
    assert tuning_table.fingerprint_key(H100) == tuning_table.fingerprint_key(dataclasses.replace(H100))
    keys = {tuning_table.fingerprint_key(H100)}
    changes = dict(device="NVIDIA H200", capability=(10, 0), driver="580.1", cuda="12.8", triton="3.5.0",
                   torch="2.10.0", redline="0.2.0")
    for field, value in changes.items():
        keys.add(tuning_table.fingerprint_key(dataclasses.replace(H100, **{field: value})))
    assert len(keys) == 1 + len(changes)


def test_cache_root_prefers_redline_variable_then_xdg_then_home():
    assert tuning_table.cache_root({"REDLINE_CACHE_DIR": "/data/rl", "XDG_CACHE_HOME": "/x"}) == Path("/data/rl")
    assert tuning_table.cache_root({"XDG_CACHE_HOME": "/x"}) == Path("/x/redline")
    assert tuning_table.cache_root({}) == Path.home() / ".cache" / "redline"


def test_table_path_names_the_device_and_fingerprint(tmp_path):
    path = tuning_table.table_path(H100, tmp_path)
    assert path == tmp_path / "autotune" / f"nvidia-h100-80gb-hbm3-{tuning_table.fingerprint_key(H100)}.json"
    assert tuning_table.table_path(dataclasses.replace(H100, triton="3.7.0"), tmp_path) != path


def test_table_path_defaults_to_the_redline_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    assert tuning_table.table_path(H100).parent == tmp_path / "autotune"


def test_saved_entries_load_back_only_under_the_same_fingerprint(tmp_path):
    path = tmp_path / "t.json"
    entries = [{"kernel": "gemm_dz", "key": [16384, 8192, 2048, "torch.int64"], "config": 1, "text": "c1"}]
    tuning_table.save(path, H100, entries)
    assert tuning_table.load(path, H100) == entries
    assert tuning_table.load(path, dataclasses.replace(H100, driver="580.1")) == []
    assert tuning_table.load(tmp_path / "missing.json", H100) == []
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # written through a temporary file, renamed


def test_a_file_that_is_not_a_table_is_named_in_the_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=str(path)):
        tuning_table.load(path, H100)
    path.write_text(json.dumps({"entries": []}))
    with pytest.raises(ValueError, match="not a redline tuning table"):
        tuning_table.load(path, H100)


def test_harvest_reads_the_autotuners_choices_and_apply_puts_them_back(toy):
    key = (1024, "torch.float32")
    _toy_kernel.cache[key] = _toy_kernel.configs[1]  # as the autotuner leaves it after timing
    entries = tuning_table.harvest(toy)
    assert entries == [{"kernel": "toy", "key": [1024, "torch.float32"], "config": 1,
                        "text": str(_toy_kernel.configs[1])}]
    restored = json.loads(json.dumps(entries))  # through the file
    _toy_kernel.cache.clear()
    assert tuning_table.apply(toy, restored) == 1
    assert _toy_kernel.cache == {key: _toy_kernel.configs[1]}  # the key exactly as the autotuner looks it up


def test_apply_skips_entries_whose_kernel_or_config_changed(toy):
    text = str(_toy_kernel.configs[0])
    stale = [{"kernel": "gone", "key": [1], "config": 0, "text": text},
             {"kernel": "toy", "key": [2], "config": 5, "text": text},
             {"kernel": "toy", "key": [3], "config": 1, "text": text},  # index 1 no longer is that config
             {"kernel": "toy", "key": [4], "config": 0, "text": text}]
    assert tuning_table.apply(toy, stale) == 1
    assert _toy_kernel.cache == {(4,): _toy_kernel.configs[0]}


def test_a_seeded_autotuner_runs_the_saved_choice_without_timing_again(toy, tmp_path):
    """End to end under the interpreter: the autotuner builds its own key, tunes, the table keeps the choice, and a
    fresh cache seeded from the file runs that config for the same key without timing any (compiled on a GPU)."""
    x = torch.zeros(10, device="cuda" if torch.cuda.is_available() else "cpu")
    TIMED.clear()
    _toy_kernel[(1,)](x, 10, 16)
    assert len(TIMED) == 2 and _toy_kernel.best_config is _toy_kernel.configs[1]
    tuning_table.save(tmp_path / "t.json", H100, tuning_table.harvest(toy))
    _toy_kernel.cache.clear()
    assert tuning_table.apply(toy, tuning_table.load(tmp_path / "t.json", H100)) == 1
    _toy_kernel[(1,)](x, 9, 16)  # another row count in the same bucket
    assert len(TIMED) == 2 and _toy_kernel.best_config is _toy_kernel.configs[1]


def test_driver_version_falls_back_to_the_driver_api_when_nvml_cannot_start(monkeypatch):
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py (the gpu extra) is not installed")

    def no_nvml():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_nvml)
    monkeypatch.setattr(tuning_table, "_driver_api_version", lambda: "cuda-driver-api 13000")
    assert tuning_table._driver_version() == "cuda-driver-api 13000"


def test_driver_api_version_names_a_library_it_cannot_load():
    with pytest.raises(OSError, match="libcuda-missing"):
        tuning_table._driver_api_version("libcuda-missing.so.1")


@pytest.mark.gpu
def test_the_fingerprint_of_this_gpu_names_its_driver():
    fp = tuning_table.current_fingerprint(torch.device("cuda"))
    assert fp.driver and fp.capability == torch.cuda.get_device_capability()
    assert tuning_table._driver_api_version().startswith("cuda-driver-api ")
