"""Ray Serve autoscaling policies, one per pool (``policies``): pure decisions over the signals
the replicas report, and the callable classes Ray Serve's controller runs every tick."""

from cluster.autoscaling.policies import (
    POLICY_STATE_KEY,
    Decision,
    DecodePolicy,
    PrefillPolicy,
    decide,
    decode_decision,
    prefill_decision,
)

__all__ = [
    "POLICY_STATE_KEY",
    "Decision",
    "DecodePolicy",
    "PrefillPolicy",
    "decide",
    "decode_decision",
    "prefill_decision",
]
