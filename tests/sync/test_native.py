"""The native library: builds with CMake from native/*.cpp, exports the allocator's C interface, and explains
itself when it (or the driver) is missing."""

import ctypes
import ctypes.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from redline.sync.memory import NativeLibraryMissing, load_native, native_library_path

ROOT = Path(__file__).resolve().parents[2]
HAVE_TOOLCHAIN = shutil.which("cmake") is not None and (shutil.which("nvcc") or os.environ.get("CUDA_HOME"))
EXPORTS = ["redline_vmm_malloc", "redline_vmm_free", "redline_vmm_pause", "redline_vmm_resume",
           "redline_vmm_mapped_bytes", "redline_vmm_reserved_bytes", "redline_vmm_host_backup_bytes",
           "redline_vmm_allocation_count", "redline_vmm_last_error"]


@pytest.fixture(scope="module")
def built_library(tmp_path_factory):
    if not HAVE_TOOLCHAIN:
        pytest.skip("building the native library needs cmake and a CUDA toolkit (nvcc); neither is on PATH")
    build = tmp_path_factory.mktemp("native")
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", "2"], check=True, capture_output=True)
    return build / "libredline_native.so"


def test_cmake_builds_the_library_with_the_allocator_interface(built_library):
    lib = ctypes.CDLL(str(built_library))
    for name in EXPORTS:
        assert hasattr(lib, name), name


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
def test_without_a_driver_allocation_fails_and_says_why(built_library):
    lib = load_native(str(built_library))
    assert lib.redline_vmm_malloc(1 << 20, 0, None) is None
    assert b"libcuda.so.1" in lib.redline_vmm_last_error()
    assert lib.redline_vmm_allocation_count() == 0


def test_a_missing_library_names_the_path_and_the_build_command(monkeypatch, tmp_path):
    monkeypatch.setenv("REDLINE_NATIVE_LIBRARY", str(tmp_path / "absent.so"))
    with pytest.raises(NativeLibraryMissing, match="absent.so.*cmake"):
        native_library_path()
