"""Where the tests find vLLM's environment (`make vllm-setup`): KVSQUEEZE_VLLM_PYTHON, else the repository's
.venv-vllm. A path named in the environment that does not exist fails the run instead of skipping its tests."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_NAMED = os.environ.get("KVSQUEEZE_VLLM_PYTHON")
VLLM_PYTHON = Path(_NAMED) if _NAMED else ROOT / ".venv-vllm" / "bin" / "python"
if _NAMED and not VLLM_PYTHON.exists():
    raise RuntimeError(f"KVSQUEEZE_VLLM_PYTHON={_NAMED} does not exist: run `make vllm-setup`, or unset it to skip "
                       "the tests that need vLLM")
