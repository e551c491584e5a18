"""Optional packages: a feature that needs a missing extra names it."""

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
