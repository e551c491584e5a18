"""Optional packages: a feature that needs a missing extra names it."""

import sys

import pytest

from redline.extras import MissingExtraError, require, version


def test_missing_optional_package_names_the_extra(monkeypatch):
    import redline.extras as extras

    monkeypatch.setitem(extras.OPTIONAL, "redline_absent_pkg", ("absent-dist", "sglang"))
    with pytest.raises(MissingExtraError, match=r"weight sync needs the package 'absent-dist'.*redline\[sglang\]"):
        require("redline_absent_pkg", "weight sync")


def test_present_package_is_returned():
    assert require("json", "anything").dumps([1]) == "[1]"


def test_version_of_missing_package_is_none():
    assert version("redline_absent_pkg") is None


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    """A ``flash_attn`` package that is found but whose ``flash_attn.cute`` fails to load (as a flash-attn-4 wheel
    does next to a mismatched CUTLASS DSL)."""
    from redline import extras

    package = tmp_path / "flash_attn"
    (package / "cute").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cute" / "__init__.py").write_text("raise ImportError('cutlass DSL 9.9 needed')\n")
    from redline.trainer.models import attention

    monkeypatch.syspath_prepend(str(tmp_path))
    extras.import_error.cache_clear()
    attention._flash_loads.cache_clear()
    yield
    extras.import_error.cache_clear()
    attention._flash_loads.cache_clear()
    for name in ("flash_attn.cute", "flash_attn"):
        sys.modules.pop(name, None)


def test_import_error_says_why_a_found_package_does_not_load(broken_flash_attn):
    from redline.extras import available, import_error, importable

    assert available("flash_attn") and not importable("flash_attn.cute")
    assert import_error("flash_attn.cute") == "ImportError: cutlass DSL 9.9 needed"
    assert import_error("json") is None


def test_env_report_and_attention_name_a_flash_attn_that_does_not_load(broken_flash_attn):
    import torch

    from redline.env_report import software
    from redline.trainer.models.attention import _flash_usable

    assert "flash_attn.cute does not load: ImportError: cutlass DSL 9.9 needed" in software()["flash-attn"]
    with pytest.warns(RuntimeWarning, match="attention runs on PyTorch SDPA"):
        assert not _flash_usable("cuda", torch.bfloat16)  # decided without touching a GPU
