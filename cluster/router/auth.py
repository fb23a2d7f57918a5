"""API keys on every route and method but health (``Authorization: Bearer <key>``)."""

from __future__ import annotations

import hmac
import ipaddress

from cluster.common.errors import ErrorCode, PDServeError
from cluster.config import RouterConfig, api_keys


class ApiKeyAuth:
    """Checks a request's ``Authorization`` header against the configured keys.

    Keys come from ``router.api_keys`` (or ``$PDSERVE_API_KEYS``) and ``router.api_keys_file``,
    read here at start (``cluster.config.api_keys``: a bad key or file is a ``ValueError`` naming
    the field); none configured: authentication is off. Comparison is constant-time and the
    error never says which part was wrong.
    """

    def __init__(self, config: RouterConfig) -> None:
        self._keys = tuple(k.encode() for k in api_keys(config))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        if not self._keys:
            return
        scheme, _, token = (authorization or "").strip().partition(" ")
        candidate = token.strip().encode()
        ok = False
        for key in self._keys:  # no early exit: every key is compared
            ok |= hmac.compare_digest(candidate, key)
        if scheme.lower() != "bearer" or not ok:
            raise PDServeError(
                ErrorCode.UNAUTHENTICATED,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard: it may be reached from elsewhere


def check_exposure(config: RouterConfig) -> str | None:
    """Public listeners (``router.host`` not loopback) need API keys, or the explicit opt-in
    ``router.allow_unauthenticated``. Refused: ``ValueError`` naming the fields. Allowed without
    keys: the warning to print (None when there is nothing to warn about)."""
    if is_loopback(config.host) or api_keys(config):
        return None
    if not config.allow_unauthenticated:
        raise ValueError(
            f"router.host: {config.host!r} is not a loopback address and no API keys are "
            "configured: set router.api_keys (or $PDSERVE_API_KEYS, router.api_keys_file), or "
            "router.allow_unauthenticated: true (pdserve serve --allow-unauthenticated) to "
            "serve anyone who can reach the ports"
        )
    return (
        f"WARNING: serving on {config.host} ports {config.http_port} (HTTP) and "
        f"{config.grpc_port} (gRPC) WITHOUT authentication (router.allow_unauthenticated): "
        "anyone who can reach them can use this cluster"
    )
