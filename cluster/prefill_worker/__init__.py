"""The prefill pool: an engine in prefill role behind a KV sender."""
