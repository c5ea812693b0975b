"""The package others install: one version, and a clear error for a torch other than the one the
extension was built against."""

import pathlib
import sys
import types

import pytest
import torch

import strata

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_one_version_source():
    init = (ROOT / "python" / "strata" / "__init__.py").read_text()
    assert f'__version__ = "{strata.__version__}"' in init
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert (
        "python/strata/__init__.py" in cmake and "project(strata VERSION ${strata_version}" in cmake
    )
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'name = "strata-tiering"' in pyproject


def test_another_torch_is_refused_at_import_with_the_fix(monkeypatch):
    fake = types.ModuleType("strata._build_info")
    fake.TORCH_VERSION = "1.0.0"
    monkeypatch.setitem(sys.modules, "strata._build_info", fake)
    with pytest.raises(ImportError, match=r"built against torch 1\.0\.0, but torch .* reinstall"):
        strata._check_torch()
    fake.TORCH_VERSION = torch.__version__
    strata._check_torch()
