"""Torch-free types shared by every layer: block hashing, sampling params, tokenizer, wire types."""
