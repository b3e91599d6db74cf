"""Numba's on-disk cache of kvsqueeze's kernels follows every source file beside a kernel, not only its own."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import numba
import pytest

from kvsqueeze import numba_cache

KERNEL_MODULES = ["kvsqueeze.kernels.numba.attend", "kvsqueeze.kernels.numba.keys", "kvsqueeze.kernels.numba.values",
                  "kvsqueeze.kernels.numba.sparse", "kvsqueeze.kernels.numba.common", "kvsqueeze.kernels.numba.encode",
                  "kvsqueeze.kernels.numba.pages", "kvsqueeze.calibrate.channels", "kvsqueeze.calibrate.kmeans"]


def _cached_dispatchers():
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, numba.core.registry.CPUDispatcher) and value._cache is not None \
                    and value.__module__ == name and hasattr(value._cache, "_impl"):
                yield f"{name}.{attr}", value


def test_every_cached_kernel_is_stamped_by_its_directory():
    assert len(numba_cache.LOCATORS) == 3, f"numba {numba.__version__} names its cache locators otherwise"
    found = dict(_cached_dispatchers())
    assert "kvsqueeze.kernels.numba.attend._attend" in found and "kvsqueeze.calibrate.kmeans._run_cost" in found
    for name, fn in found.items():
        locator = fn._cache._impl.locator
        assert isinstance(locator, numba_cache.LOCATORS), f"{name}: numba's own locator {type(locator).__name__}"
        directory = Path(fn.py_func.__code__.co_filename).resolve().parent
        assert locator.get_source_stamp()[1] == numba_cache.directory_digest(directory), name


def test_digest_changes_with_a_sibling_file(tmp_path):
    src = Path(importlib.import_module("kvsqueeze.kernels.numba.keys").__file__).parent
    copy = tmp_path / "kernels"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = numba_cache.directory_digest.__wrapped__
    before = digest(copy)
    assert before == digest(src)
    keys = copy / "keys.py"  # the file of the sink pass that `_attend` (in attend.py) calls
    keys.write_text(keys.read_text() + "\n# changed\n")
    changed = digest(copy)
    assert changed != before
    (copy / "notes.txt").write_text("not a source file")  # only .py files count
    assert digest(copy) == changed


@pytest.mark.parametrize("locator", numba_cache.LOCATORS)
def test_other_packages_keep_numbas_locators(locator, tmp_path):
    other = tmp_path / "elsewhere.py"
    other.write_text("def f():\n    return 1\n")
    assert locator.from_function(lambda: 1, str(other)) is None
    numba_cache.install()
    numba_cache.install()
    classes = numba.core.caching.CacheImpl._locator_classes
    assert sum(c in numba_cache.LOCATORS for c in classes) == len(numba_cache.LOCATORS)
