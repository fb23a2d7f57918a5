"""Speculative decoding (``decode.speculative``): proposers, the engine's ``Speculator`` and
exact verification. ``proposer``: the ``propose(requests) -> drafts`` interface and prompt
lookup; ``speculator``: who drafts how much each step (adaptive) and the accounting;
``verify``: sampling a step's rows and accepting drafts (every runner's last stage)."""

from __future__ import annotations

from cluster.engine.spec.proposer import NgramProposer, Proposer
from cluster.engine.spec.speculator import PROPOSERS, Speculator, create_speculator
from cluster.engine.spec.verify import sample_and_verify, sample_request

__all__ = [
    "PROPOSERS",
    "NgramProposer",
    "Proposer",
    "Speculator",
    "create_speculator",
    "sample_and_verify",
    "sample_request",
]
