"""Range checks of config dataclasses: bad input is one ValueError naming the field, the bound and the value.

`require_at_least(self, 1, "a", "b")` in a `__post_init__` replaces one `if self.a < 1: raise ...`
per field; the message is `<Class>.<field> must be >= 1, got <value>` (`prefix` replaces the class
name where the user knows the config by another, e.g. its YAML choice `off_policy`). NaN fails too.
"""

from __future__ import annotations

import ipaddress
from typing import Optional


def require_at_least(config, minimum: float, *fields: str, prefix: Optional[str] = None) -> None:
    """Raises for the first of `fields` of `config` that is not >= `minimum`."""
    _require(config, fields, prefix, lambda v: v >= minimum, f">= {minimum}")


def require_above(config, bound: float, *fields: str, prefix: Optional[str] = None) -> None:
    """Raises for the first of `fields` of `config` that is not > `bound`."""
    _require(config, fields, prefix, lambda v: v > bound, f"> {bound}")


def _require(config, fields, prefix, ok, bound: str) -> None:
    owner = type(config).__name__ if prefix is None else prefix
    for name in fields:
        value = getattr(config, name)
        if not ok(value):
            raise ValueError(f"{owner}.{name} must be {bound}, got {value}")


def check_api_key(key, name: str = "api_key") -> str:
    """`key` if it can be an API key (non-empty, printable ASCII without spaces: it travels in an HTTP
    header); else ValueError naming `name` (the key itself is never shown)."""
    if not isinstance(key, str) or not key or not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{name} must be a non-empty string of printable ASCII characters without spaces "
                         "(it is sent as the header 'Authorization: Bearer <key>')")
    return key


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
