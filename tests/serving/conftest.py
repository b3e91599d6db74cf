# collecting tests/serving checks the vLLM environment first: a path named in KVSQUEEZE_VLLM_PYTHON that does not
# exist fails the run (`vllm_env`)
from tests.serving import vllm_env  # noqa: F401
