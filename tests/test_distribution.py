"""The distribution name: `zephon-loader`, and one clear line when the other `zephon` is installed."""

import sys
import warnings

import pytest

from zephon import _distribution


def _fake_dist(root, summary):
    info = root / "zephon-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: zephon\nVersion: 0.2.0\nSummary: {summary}\n")
    return str(root)


def test_the_other_zephon_installed_beside_it_is_named_in_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [_fake_dist(tmp_path, "High-performance, modular data loader"), *sys.path])
    with pytest.warns(RuntimeWarning, match=r"another project named 'zephon' \(0.2.0\).*pip uninstall zephon"):
        _distribution.warn_if_shadowed()


def test_no_warning_without_it_or_for_this_projects_own_old_metadata(tmp_path, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _distribution.warn_if_shadowed()   # the test environment has only zephon-loader
        monkeypatch.setattr(sys, "path", [_fake_dist(tmp_path, "Elastically deterministic, multi-backend"),
                                          *sys.path])
        _distribution.warn_if_shadowed()


def test_the_installed_version_is_the_packages():
    import zephon

    assert _distribution.version() == zephon.__version__


def test_every_package_is_in_the_wheel():
    """pyproject lists packages by hand (backends/ and compat/ install as zephon.backends and
    zephon.compat): a package directory missing from it would be absent from the wheel."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("zephon", "zephon"), ("backends", "zephon.backends"), ("compat", "zephon.compat")):
        for init in (root / top).rglob("__init__.py"):
            rel = init.parent.relative_to(root / top).parts
            found.add(".".join((name, *rel)))
    missing = sorted(found - listed)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"
