"""Numba's on-disk cache of kvsqueeze's kernels, kept only while every source file beside a kernel is unchanged.

Numba keys a cached function on its own file alone. A kernel that calls functions of other files (the fused
decode `_attend` calls the key, value, sink and outlier passes of four others) would otherwise load its machine
code from the cache after one of those files changed, and run the old code without a word. `install()` puts a
locator before numba's own ones for files inside this package: the same cache places, with a source stamp that
also holds a digest of every `.py` file in the kernel's directory. It runs before any kernel is defined (the
kernel packages import this module first) and does nothing for other packages' functions.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

PACKAGE = Path(__file__).resolve().parent


@functools.cache
def directory_digest(directory: Path) -> str:
    """sha256 over the names and contents of the `.py` files directly in `directory`, in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _ours(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(PACKAGE)
    except (OSError, ValueError):
        return False


def _stamped(base: type) -> type:
    class Locator(base):
        @classmethod
        def from_function(cls, py_func, py_file):
            return super().from_function(py_func, py_file) if _ours(py_file) else None

        def get_source_stamp(self):
            return super().get_source_stamp(), directory_digest(Path(self._py_file).resolve().parent)

    Locator.__name__ = Locator.__qualname__ = f"Directory{base.__name__}"
    return Locator


_BASES = tuple(getattr(caching, n, None) for n in ("UserProvidedCacheLocator", "InTreeCacheLocator",
                                                   "UserWideCacheLocator"))
# a numba that names its locators otherwise keeps its own behaviour (the tests require these names)
LOCATORS = tuple(_stamped(c) for c in _BASES) if all(_BASES) else ()


def install() -> None:
    """Put `LOCATORS` first in numba's list (once)."""
    classes = getattr(getattr(caching, "CacheImpl", None), "_locator_classes", None)
    if LOCATORS and isinstance(classes, list) and not any(c in LOCATORS for c in classes):
        classes[:0] = LOCATORS
