"""The CuTe-DSL LM-head GEMMs compile for every architecture ``lm_head_gemm_cute.CONFIGS`` lists (sm_90, sm_100) on a
machine without a GPU (``cute_compile.py``, one process per architecture): what a GPU run would otherwise be the
first to find out, and the only check sm_100 gets until a B200 is lent. Runs where QuACK is installed (the ``gpu``
extra)."""

import json
import os
import subprocess
import sys

import pytest

HELPER = os.path.join(os.path.dirname(__file__), "cute_compile.py")


@pytest.mark.slow  # the DSL's compiler, seconds per variant
@pytest.mark.parametrize("capability, arch", [("9.0", "sm_90a"), ("10.0", "sm_100a")])
def test_every_variant_compiles_without_a_gpu(capability, arch):
    pytest.importorskip("quack.epilogue.frontend", reason="QuACK is not installed: pip install 'redline[gpu]'")
    env = {**os.environ, "CUTE_DSL_ARCH": arch}
    done = subprocess.run([sys.executable, HELPER, capability], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {"stats", "stats+offsets", "dz"}
    for name, entry in report.items():
        assert entry["compiled"], (arch, name, entry.get("error"))
