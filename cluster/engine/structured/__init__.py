"""Structured output: grammar-constrained decoding with llguidance (``output.StructuredOutput``,
the engine's collaborator; ``grammar``: vocabulary and compiled-grammar cache; ``masks``: a
step's token masks)."""

from __future__ import annotations

from cluster.engine.structured.grammar import GrammarCache, build_vocab
from cluster.engine.structured.masks import BatchMasks
from cluster.engine.structured.output import StructuredOutput

__all__ = ["BatchMasks", "GrammarCache", "StructuredOutput", "build_vocab"]
