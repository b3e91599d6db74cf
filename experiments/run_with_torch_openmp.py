"""Run a script with torch's libgomp in the process's global symbol scope, so numba's OpenMP threading layer binds
to torch's OpenMP runtime instead of loading a second pool of threads beside it.

numba's OpenMP layer (`omppool`) asks for the system's libgomp; torch brings its own. Loaded into the global
scope first (`RTLD_GLOBAL`), torch's copy is the one `omppool`'s `GOMP_parallel` and `omp_*` calls bind to
(`LD_DEBUG=bindings` shows it). Used to test whether the two runtimes are what makes `nuq3-1%`'s decode step at
32K swing between runs (docs/notes.md: they are not):

    python experiments/run_with_torch_openmp.py benchmarks/decode.py --contexts 8192,32768 \\
        --methods nuq3-1%,nuq@3.5:r32:chan --step --no-reference --rounds 15 --json /tmp/step.json
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys

import torch

ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"), mode=ctypes.RTLD_GLOBAL)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
