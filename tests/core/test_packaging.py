"""Packaging: only `redline` lands in site-packages; the subsystems are `redline.<name>`."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import redline

ROOT = Path(__file__).resolve().parents[2]


def test_subsystems_import_as_redline_subpackages():
    import redline.kernels
    import redline.rollout
    import redline.sync
    import redline.trainer

    for module, folder in [(redline.kernels, "kernels"), (redline.trainer, "trainer"),
                           (redline.rollout, "rollout"), (redline.sync, "sync")]:
        assert module.__name__.startswith("redline.")
        assert Path(module.__file__).parent.name == folder


@pytest.mark.slow
def test_wheel_holds_nothing_but_redline(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), "-q"], check=True, env={**os.environ, "REDLINE_SKIP_NATIVE": "1"})
    (wheel,) = tmp_path.glob("redline-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"redline", f"redline-{redline.__version__}.dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    for sub in ["kernels", "trainer", "rollout", "sync", "loop"]:
        assert f"redline/{sub}/__init__.py" in names


def test_bare_folder_names_resolve_to_the_redline_packages():
    """From the repository root the folders are importable by their bare names (transformers probes for a
    top-level ``kernels``); that must hand out the real package, not a second copy that re-registers ops."""
    code = ("import kernels, trainer, rollout, sync, redline.kernels as k, redline.trainer as t, "
            "redline.rollout as r, redline.sync as s; "
            "assert (kernels, trainer, rollout, sync) == (k, t, r, s); "
            "from transformers.utils.import_utils import is_kernels_available; assert not is_kernels_available()")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
