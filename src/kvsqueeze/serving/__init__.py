"""Serving engines: the compressed cache in their paged memory (no transformers needed)."""
