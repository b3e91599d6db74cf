"""kvsqueeze: KVQuant-style 2/3/4-bit KV-cache quantization for Hugging Face LLaMA-family models."""

__version__ = "0.1.0"
