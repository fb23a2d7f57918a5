"""A tensor-parallel engine's other rank: ``python -m cluster.engine.tp_rank_main`` (started by
``tp_ranks.spawn_ranks``, its ``RankSpec`` as JSON on stdin)."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

from cluster.engine.torch_runner import TorchModelRunner
from cluster.engine.tp_group import RankFailure
from cluster.engine.tp_ranks import RankSpec

logger = logging.getLogger(__name__)


def _report(kind: str, text: str = "") -> None:
    sys.stdout.write(json.dumps({"kind": kind, "text": text}) + "\n")
    sys.stdout.flush()


def rank_main() -> None:
    """A rank process: load the shard, report, then run the driver's steps until ``STOP``."""
    spec = RankSpec.from_json(sys.stdin.read())
    try:
        runner = TorchModelRunner(
            spec.config, Path(spec.model_dir) if spec.model_dir else None, rank=spec
        )
    except BaseException as exc:  # the driver names it in its start-up error
        _report("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
        raise SystemExit(1) from None
    _report("ready")
    try:
        runner.follow_driver()
    except RankFailure as exc:  # the driver went away: nothing left to serve
        logger.info("tensor-parallel rank %d stops: %s", spec.rank, exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    rank_main()
