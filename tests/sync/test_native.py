"""The native library: builds with CMake from native/*.cpp, exports the allocator's C interface, explains
itself when it (or the driver) is missing, and (on its host-memory imitation of the driver) keeps contents
across pauses while reusing its pinned host buffers."""

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
EXPORTS = ["redline_vmm_malloc", "redline_vmm_free", "redline_vmm_pause", "redline_vmm_pause_some",
           "redline_vmm_allocation_bytes", "redline_vmm_resume",
           "redline_vmm_release_host", "redline_vmm_mapped_bytes", "redline_vmm_reserved_bytes",
           "redline_vmm_host_backup_bytes", "redline_vmm_host_allocations", "redline_vmm_allocation_count",
           "redline_vmm_last_error", "redline_vmm_use_fake_driver"]
PAGE = 4096  # the imitation's allocation granularity


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


@pytest.fixture
def fake(built_library, tmp_path):
    """A private copy of the library (its own globals) running on the host-memory imitation of the driver."""
    copy = tmp_path / "libredline_native_fake.so"
    shutil.copy(built_library, copy)
    lib = load_native(str(copy))
    assert lib.redline_vmm_use_fake_driver() == 0
    return lib


def write(address, data: bytes):
    ctypes.memmove(address, data, len(data))


def read(address, n) -> bytes:
    return ctypes.string_at(address, n)


def allocate(lib, nbytes):
    address = lib.redline_vmm_malloc(nbytes, 0, None)
    assert address, lib.redline_vmm_last_error()
    return address


def test_contents_survive_pause_and_resume_at_the_same_address(fake):
    a, b = allocate(fake, 3 * PAGE + 5), allocate(fake, 100)
    write(a, b"weights" * 1000)
    write(b, b"x" * 100)
    assert fake.redline_vmm_pause(1) == 0
    assert fake.redline_vmm_mapped_bytes() == 0 and fake.redline_vmm_host_backup_bytes() == 3 * PAGE + 5 + 100
    assert fake.redline_vmm_resume() == 0
    assert read(a, 7000) == b"weights" * 1000 and read(b, 100) == b"x" * 100


def test_later_pauses_reuse_the_pinned_host_buffers(fake):
    a = allocate(fake, 2 * PAGE)
    for step in range(5):
        write(a, bytes([step]) * 64)
        assert fake.redline_vmm_pause(1) == 0
        assert fake.redline_vmm_resume() == 0
        assert read(a, 64) == bytes([step]) * 64
    assert fake.redline_vmm_host_allocations() == 1  # pinned once, at the first pause
    assert fake.redline_vmm_host_backup_bytes() == 2 * PAGE  # kept for the next pause


def test_a_pause_without_contents_does_not_restore_stale_ones(fake):
    a = allocate(fake, PAGE)
    write(a, b"old" * 10)
    fake.redline_vmm_pause(1)
    fake.redline_vmm_resume()
    write(a, b"new" * 10)
    fake.redline_vmm_pause(0)
    fake.redline_vmm_resume()
    assert read(a, 30) not in (b"old" * 10, b"new" * 10)  # fresh physical memory: contents undefined


def test_release_host_frees_kept_buffers_and_the_next_pause_pins_again(fake):
    a = allocate(fake, PAGE)
    fake.redline_vmm_pause(1)
    fake.redline_vmm_resume()
    assert fake.redline_vmm_release_host() == PAGE and fake.redline_vmm_host_backup_bytes() == 0
    write(a, b"kept")
    fake.redline_vmm_pause(1)
    fake.redline_vmm_resume()
    assert read(a, 4) == b"kept" and fake.redline_vmm_host_allocations() == 2


def test_release_host_keeps_buffers_that_hold_paused_contents(fake):
    a = allocate(fake, PAGE)
    write(a, b"paused")
    fake.redline_vmm_pause(1)
    assert fake.redline_vmm_release_host() == 0
    fake.redline_vmm_resume()
    assert read(a, 6) == b"paused"


def test_freeing_a_paused_allocation_frees_its_host_buffer(fake):
    a = allocate(fake, PAGE)
    fake.redline_vmm_pause(1)
    fake.redline_vmm_free(a, PAGE, 0, None)
    assert fake.redline_vmm_allocation_count() == 0 and fake.redline_vmm_host_backup_bytes() == 0


def pause_some(lib, pointers, keep):
    return lib.redline_vmm_pause_some((ctypes.c_void_p * len(pointers))(*pointers),
                                      (ctypes.c_int * len(keep))(*keep), len(pointers))


def test_pause_some_releases_only_the_listed_allocations_each_by_its_flag(fake):
    kept, dropped, untouched = allocate(fake, PAGE), allocate(fake, 2 * PAGE), allocate(fake, PAGE)
    for address, text in ((kept, b"kept"), (dropped, b"dropped"), (untouched, b"untouched")):
        write(address, text)
    assert pause_some(fake, [dropped, kept], [0, 1]) == 0
    assert fake.redline_vmm_mapped_bytes() == PAGE  # only `untouched` still mapped
    assert fake.redline_vmm_host_backup_bytes() == PAGE  # only `kept` went to the host
    assert read(untouched, 9) == b"untouched"  # readable while the others are paused
    assert fake.redline_vmm_resume() == 0
    assert read(kept, 4) == b"kept" and read(dropped, 7) != b"dropped"


def test_pause_some_refuses_a_pointer_inside_an_allocation_and_pauses_nothing(fake):
    a = allocate(fake, 2 * PAGE)
    assert pause_some(fake, [a, a + PAGE], [1, 1]) == -1
    assert b"not the start of an allocation" in fake.redline_vmm_last_error()
    assert fake.redline_vmm_mapped_bytes() == 2 * PAGE


def test_allocation_bytes_is_the_size_rounded_to_the_granularity(fake):
    assert fake.redline_vmm_allocation_bytes(allocate(fake, PAGE + 1)) == 2 * PAGE
    assert fake.redline_vmm_allocation_bytes(12345) == 0
