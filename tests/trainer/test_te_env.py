"""Library setup for TransformerEngine next to pip torch (``redline.trainer.layers.te_env``), on fake trees."""

import ctypes
import sys

import pytest

from redline.trainer.layers import te_env

CUDNN_FILES = ("libcudnn.so.9", "libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_graph.so.9",
               "libcudnn_ops.so.9")
CU13_FILES = ("libnvrtc.so.13", "libnvrtc-builtins.so.13.0", "libnvrtc.alt.so.13", "libnvJitLink.so.13",
              "libcublas.so.13")


def fake_nvidia(root, layout="cu13"):
    """A ``nvidia`` package folder holding empty library files laid out as the pip wheels do."""
    nvidia = root / "nvidia"
    for name in CUDNN_FILES:
        (nvidia / "cudnn" / "lib").mkdir(parents=True, exist_ok=True)
        (nvidia / "cudnn" / "lib" / name).write_bytes(b"")
    if layout == "cu13":
        (nvidia / "cu13" / "lib").mkdir(parents=True)
        for name in CU13_FILES:
            (nvidia / "cu13" / "lib" / name).write_bytes(b"")
    else:  # CUDA 12 wheels: one folder per library
        for folder, name in (("cuda_nvrtc", "libnvrtc.so.12"), ("nvjitlink", "libnvJitLink.so.12")):
            (nvidia / folder / "lib").mkdir(parents=True)
            (nvidia / folder / "lib" / name).write_bytes(b"")
    return nvidia


def test_pip_library_dirs_finds_cudnn_and_the_shared_cuda13_folder(tmp_path):
    nvidia = fake_nvidia(tmp_path)
    assert te_env.pip_library_dirs([nvidia]) == {"cudnn": nvidia / "cudnn" / "lib", "nvrtc": nvidia / "cu13" / "lib",
                                                 "nvjitlink": nvidia / "cu13" / "lib"}


def test_pip_library_dirs_finds_the_cuda12_per_library_folders(tmp_path):
    nvidia = fake_nvidia(tmp_path, layout="cu12")
    dirs = te_env.pip_library_dirs([nvidia])
    assert dirs["nvrtc"] == nvidia / "cuda_nvrtc" / "lib" and dirs["nvjitlink"] == nvidia / "nvjitlink" / "lib"


def test_te_library_env_puts_torch_libraries_first_and_points_te_loader_at_them(tmp_path):
    nvidia = fake_nvidia(tmp_path)
    cudnn, cu13 = str(nvidia / "cudnn" / "lib"), str(nvidia / "cu13" / "lib")
    env = te_env.te_library_env({"LD_LIBRARY_PATH": f"/usr/local/cuda/lib64:{cu13}"}, roots=[nvidia])
    assert env["LD_LIBRARY_PATH"] == f"{cudnn}:{cu13}:/usr/local/cuda/lib64"  # no folder twice
    assert env["CUDNN_HOME"] == env["CUDNN_PATH"] == str(nvidia / "cudnn")
    assert env["NVRTC_HOME"] == str(nvidia / "cu13")


def test_te_library_env_is_empty_without_pip_nvidia_libraries(tmp_path):
    assert te_env.te_library_env({}, roots=[tmp_path]) == {}


def test_preload_order_loads_nvrtc_before_the_cudnn_dispatcher_and_its_graph_library(tmp_path):
    nvidia = fake_nvidia(tmp_path)
    order = [p.name for p in te_env.preload_order(te_env.pip_library_dirs([nvidia]))]
    assert order == ["libnvJitLink.so.13", "libnvrtc.so.13", "libnvrtc-builtins.so.13.0", "libcudnn.so.9",
                     "libcudnn_graph.so.9", "libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9",
                     "libcudnn_ops.so.9"]


MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 08:01 11 /venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
7f0000001000-7f0000002000 r--p 00001000 08:01 11 /venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
7f0000002000-7f0000003000 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libcudnn.so.9.19.0
7f0000003000-7f0000004000 r-xp 00000000 08:01 13 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13
7f0000004000-7f0000005000 r-xp 00000000 08:01 14 /usr/lib/x86_64-linux-gnu/libz.so.1
7f0000005000-7f0000006000 rw-p 00000000 00:00 0 [heap]
"""


def test_loaded_libraries_lists_each_cuda_library_once_in_mapping_order():
    assert te_env.loaded_libraries(MAPS) == [
        "/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9",
        "/usr/lib/x86_64-linux-gnu/libcudnn.so.9.19.0",
        "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13"]


def test_loaded_cudnn_dirs_reveals_two_cudnn_copies():
    assert te_env.loaded_cudnn_dirs(MAPS) == ["/venv/lib/python3.12/site-packages/nvidia/cudnn/lib",
                                              "/usr/lib/x86_64-linux-gnu"]


@pytest.fixture
def clean_prepare(monkeypatch):
    """``prepare_te_libraries`` runs afresh and every variable it sets is restored after the test."""
    te_env.prepare_te_libraries.cache_clear()
    for key in ("LD_LIBRARY_PATH", "CUDNN_HOME", "CUDNN_PATH", "NVRTC_HOME", te_env.OFF_VARIABLE):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    yield monkeypatch
    te_env.prepare_te_libraries.cache_clear()


def test_prepare_sets_the_loader_variables_and_loads_every_library_globally(tmp_path, clean_prepare):
    nvidia = fake_nvidia(tmp_path)
    loads = []
    clean_prepare.setattr(te_env, "nvidia_roots", lambda: [nvidia])
    clean_prepare.setattr(te_env, "loaded_cudnn_dirs", lambda maps_text=None: [])  # torch has not used cuDNN yet
    clean_prepare.setattr(te_env.ctypes, "CDLL", lambda path, mode: loads.append((path, mode)))
    report = te_env.prepare_te_libraries()
    assert te_env.os.environ["CUDNN_HOME"] == str(nvidia / "cudnn")
    assert te_env.os.environ["LD_LIBRARY_PATH"].startswith(str(nvidia / "cudnn" / "lib"))
    assert [p for p, _ in loads] == report["loaded"] == [str(p) for p in te_env.preload_order(
        te_env.pip_library_dirs([nvidia]))]
    assert {mode for _, mode in loads} == {ctypes.RTLD_GLOBAL}


def test_prepare_follows_the_cudnn_torch_already_loaded(tmp_path, clean_prepare):
    nvidia = fake_nvidia(tmp_path)
    other = tmp_path / "venv2" / "nvidia"
    (other / "cudnn" / "lib").mkdir(parents=True)
    (other / "cudnn" / "lib" / "libcudnn.so.9").write_bytes(b"")
    clean_prepare.setattr(te_env, "nvidia_roots", lambda: [nvidia, other])
    clean_prepare.setattr(te_env, "loaded_cudnn_dirs", lambda maps_text=None: [str(other / "cudnn" / "lib")])
    clean_prepare.setattr(te_env.ctypes, "CDLL", lambda path, mode: None)
    report = te_env.prepare_te_libraries()
    assert te_env.os.environ["CUDNN_HOME"] == str(other / "cudnn")
    assert str(other / "cudnn" / "lib" / "libcudnn.so.9") in report["loaded"]
    assert not any(str(nvidia / "cudnn") in p for p in report["loaded"])


def test_prepare_reports_libraries_that_fail_to_load_and_goes_on(tmp_path, clean_prepare):
    nvidia = fake_nvidia(tmp_path)  # empty files: not loadable
    clean_prepare.setattr(te_env, "nvidia_roots", lambda: [nvidia])
    clean_prepare.setattr(te_env, "loaded_cudnn_dirs", lambda maps_text=None: [])
    report = te_env.prepare_te_libraries()
    assert report["loaded"] == [] and len(report["failed"]) == len(te_env.preload_order(
        te_env.pip_library_dirs([nvidia])))


def test_prepare_can_be_switched_off(clean_prepare):
    clean_prepare.setenv(te_env.OFF_VARIABLE, "off")
    report = te_env.prepare_te_libraries()
    assert "skipped" in report and "CUDNN_HOME" not in te_env.os.environ


def test_prepare_does_nothing_once_transformer_engine_is_imported(clean_prepare):
    clean_prepare.setitem(sys.modules, "transformer_engine", object())
    assert "imported before" in te_env.prepare_te_libraries()["skipped"]
