"""Paged compressed KV memory for serving engines (no transformers needed)."""
