"""A made-up but plausible profile for the planner's unit tests (no measurement needed)."""

from __future__ import annotations

from cluster.planner.profile import Profile, ServingCost, StepCosts, TransferCost


def costs(f: float) -> StepCosts:
    return StepCosts(
        (1, 16, 64, 256, 1024, 4096),
        (0.03 * f, 0.04 * f, 0.07 * f, 0.2 * f, 0.8 * f, 3.5 * f),
        2e-7 * f,
        (1, 4, 16, 64),
        (128, 1024),
        ((0.03 * f, 0.035 * f), (0.035 * f, 0.04 * f), (0.05 * f, 0.07 * f), (0.1 * f, 0.2 * f)),
    )


def synthetic_profile(local_s: float = 0.01, remote_s: float = 0.02) -> Profile:
    return Profile(
        device={"kind": "cpu", "name": "synthetic"},
        model={"name": "m", "dtype": "float32", "block_size": 16, "bytes_per_block": 737280},
        steps={"1": costs(1.0), "2": costs(0.6)},
        transfer={"shm": TransferCost(0.001, 5e9), "zmq": TransferCost(0.002, 1.5e9)},
        serving={"local": ServingCost(local_s), "remote": ServingCost(remote_s)},
    )
