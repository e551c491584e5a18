"""benchmarks/stage_peers.py: the e2e benchmark's peer bundles on top of the shared staging tool, and the venv
its vllm bundle installs into (offline: nothing is downloaded here)."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import stage_peers  # noqa: E402

INSTALL_SH = "#!/usr/bin/env bash\nset -euo pipefail\nSTAGE=/tmp/stage-x\n{install}\n"


def test_vllm_install_goes_into_a_venv_that_sees_the_images_venv(tmp_path):
    image = tmp_path / "image"  # the GPU machine's python3 is itself a venv (/opt/torch/.venv)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(image)], check=True)
    purelib = subprocess.run([str(image / "bin" / "python3"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "image_marker.py").write_text("")
    install = tmp_path / "install.sh"
    venv = tmp_path / "venv"
    # where the shared tool's install.sh runs `python3 -m pip install`: which python3, and what it imports
    install.write_text(INSTALL_SH.format(install='python3 -c "import sys, image_marker; print(sys.prefix)"'))
    stage_peers.install_into_venv(install, str(venv))
    out = subprocess.run(["bash", str(install)], capture_output=True, text=True, check=True,
                         env={"PATH": f"{image / 'bin'}:/usr/bin:/bin"})
    assert out.stdout.strip() == str(venv)  # the new venv's python3, seeing the image venv's packages


def test_an_install_sh_without_the_anchor_is_refused(tmp_path):
    install = tmp_path / "install.sh"
    install.write_text("#!/bin/sh\npython3 -m pip install x\n")
    with pytest.raises(RuntimeError, match="install_into_venv"):
        stage_peers.install_into_venv(install, str(tmp_path / "venv"))
