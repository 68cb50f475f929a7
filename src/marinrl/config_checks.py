"""Range checks of config dataclasses: bad input is one ValueError naming the field, the bound and the value.

`require_at_least(self, 1, "a", "b")` in a `__post_init__` replaces one `if self.a < 1: raise ...`
per field; the message is `<Class>.<field> must be >= 1, got <value>` (`prefix` replaces the class
name where the user knows the config by another, e.g. its YAML choice `off_policy`). NaN fails too.
"""

from __future__ import annotations

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
