"""API keys on every route and method but health (``Authorization: Bearer <key>``)."""

from __future__ import annotations

import hmac
from pathlib import Path

from cluster.common.errors import ErrorCode, PDServeError
from cluster.config import RouterConfig


def _read_keys_file(path: str) -> tuple[str, ...]:
    p = Path(path).expanduser()
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"router.api_keys_file: cannot read {str(p)!r}: {e.strerror}") from None
    keys = tuple(k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"router.api_keys_file: {str(p)!r} holds no keys")
    for key in keys:
        if len(key) < 8:
            raise ValueError("router.api_keys_file: keys must be at least 8 characters")
    return keys


class ApiKeyAuth:
    """Checks a request's ``Authorization`` header against the configured keys.

    Keys come from ``router.api_keys`` (or ``$PDSERVE_API_KEYS``, through config.py) and
    ``router.api_keys_file``; none configured: authentication is off. Comparison is constant-time
    and the error never says which part was wrong.
    """

    def __init__(self, config: RouterConfig) -> None:
        keys = list(config.api_keys)
        if config.api_keys_file:
            keys.extend(_read_keys_file(config.api_keys_file))
        self._keys = tuple(k.encode() for k in dict.fromkeys(keys))

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
