"""``serving.replica.QuietProbes``: a pool replica's log keeps every call but the router's
successful readiness probes (one every 0.5 s, each answered on the decode and the prefill pool).

The lines are made with Ray Serve's own formatter, so a change of its format fails here rather
than quietly letting the probes flood the logs again.
"""

from __future__ import annotations

import logging

import pytest
from ray.serve._private.logging_utils import access_log_msg

from cluster.serving.replica import SERVE_LOGGER, QuietProbes, quiet_probe_logs


def access_record(route: str, status: str, client: str = "") -> logging.LogRecord:
    msg = access_log_msg(method="CALL", route=route, status=status, latency_ms=1.25, client=client)
    record = logging.LogRecord(SERVE_LOGGER, logging.INFO, __file__, 1, msg, None, None)
    record.serve_access_log = True
    return record


@pytest.mark.parametrize("client", ["", "10.0.0.7:51234"])
def test_only_successful_probes_are_dropped(client: str) -> None:
    quiet = QuietProbes()
    assert not quiet.filter(access_record("ready", "OK", client))
    # A probe that failed or was cancelled says something: kept.
    assert quiet.filter(access_record("ready", "ERROR", client))
    assert quiet.filter(access_record("ready", "CANCELLED", client))
    # Every real call is kept, whatever its outcome.
    for route in ("generate", "prefill", "stats", "check_integrity", "already"):
        assert quiet.filter(access_record(route, "OK", client))
    # Not an access-log line (a warning that mentions the probe): kept.
    other = logging.LogRecord(
        SERVE_LOGGER, logging.WARNING, __file__, 1, "CALL ready OK 1ms", None, None
    )
    assert quiet.filter(other)


def test_installed_once_on_serves_logger(caplog: pytest.LogCaptureFixture) -> None:
    serve_logger = logging.getLogger(SERVE_LOGGER)
    before = list(serve_logger.filters)
    try:
        quiet_probe_logs()
        quiet_probe_logs()  # a second replica class in the same process
        assert sum(isinstance(f, QuietProbes) for f in serve_logger.filters) == 1
        with caplog.at_level(logging.INFO, logger=SERVE_LOGGER):
            for route in ("ready", "generate"):
                rec = access_record(route, "OK")
                serve_logger.info(rec.msg, extra={"serve_access_log": True})
        assert [r.getMessage().split(" ")[1] for r in caplog.records] == ["generate"]
    finally:
        serve_logger.filters[:] = before
