"""API keys on every route and method but health (``Authorization: Bearer <key>``)."""

from __future__ import annotations

import hmac

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
