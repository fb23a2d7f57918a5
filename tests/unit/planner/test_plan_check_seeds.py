"""`pdserve plan --validate` runs its mixes one after another on one deployment: each mix must
send prompts of its own, or a later mix hits the prefix cache an earlier one filled while its
simulation starts cold (with one seed, chat-heavy's first 16 prompts were mixed-long's)."""

from __future__ import annotations

import itertools

from cluster.planner.measure.validate import MIXES, mix_seed
from cluster.planner.workload import WORKLOADS

BLOCK = 16  # the default cache block: a shared first block is a prefix-cache hit


def test_no_mix_shares_a_first_block_with_another() -> None:
    firsts = {}
    for i, name in enumerate(MIXES):
        items = WORKLOADS[name].items(40, 49152, seed=mix_seed(i))
        firsts[name] = {tuple(it.token_ids[:BLOCK]) for it in items}
        assert len(firsts[name]) == len(items), f"{name}: two of its own prompts share a block"
    for a, b in itertools.combinations(MIXES, 2):
        assert not firsts[a] & firsts[b], f"{a} and {b} send prompts with the same first block"


def test_one_seed_for_all_mixes_would_replay_prompts() -> None:
    # What the check did before: the same seed for every mix.
    a = {tuple(it.token_ids[:BLOCK]) for it in WORKLOADS["mixed-long"].items(24, 49152, seed=100)}
    b = {tuple(it.token_ids[:BLOCK]) for it in WORKLOADS["chat-heavy"].items(24, 49152, seed=100)}
    assert len(a & b) >= 16
