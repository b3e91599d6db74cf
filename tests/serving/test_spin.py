"""`vllm_run` shortens torch's OpenMP spinning before torch loads, and leaves a user's own setting alone."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = ("import os, sys; from kvsqueeze.serving.vllm_run import short_spin; took = short_spin(); import torch; "
         "print(took, 'torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))")


def _run(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_short_spin_before_torch():
    from kvsqueeze.serving.vllm_run import SPINCOUNT

    assert _run({}) == ["True", "True", SPINCOUNT]


def test_short_spin_keeps_the_users_value():
    assert _run({"GOMP_SPINCOUNT": "77"}) == ["True", "True", "77"]


def test_short_spin_after_torch_says_so():
    import torch  # noqa: F401  loaded in this process already

    from kvsqueeze.serving.vllm_run import short_spin

    before = os.environ.get("GOMP_SPINCOUNT")
    assert short_spin() is False
    assert os.environ.get("GOMP_SPINCOUNT") == before
