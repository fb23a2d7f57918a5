"""Torch-free types every layer shares: errors, fault points, block hashing, the KV layout, the
messages between pools, sampling params, the tokenizer."""
