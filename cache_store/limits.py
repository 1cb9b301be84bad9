"""Size limits of a store, validated in one place: every caller (both stores' ``set_limits`` and
``prune``, the eviction after each write, Chorus Cache Maintenance, the command line) goes through
these functions, so a bad number is a clear ``ValueError`` that deletes nothing.

Two kinds of limit:

* **Stored limits** (``set_limits``, kept in the store): ``max_bytes`` an int in
  ``[1, MAX_LIMIT]``; ``max_entries`` an int in ``[0, MAX_LIMIT]``, 0 meaning *no entry cap*;
  ``eviction`` one of :data:`EVICTION_POLICIES`.
* **Prune targets** (``prune(max_bytes=, max_entries=)``, one eviction run now): ints in
  ``[0, MAX_LIMIT]`` meaning *keep at most this many*, so 0 keeps nothing (the command line asks
  for ``--delete-all`` before it passes a 0); ``None`` means the stored limit.

Refused everywhere: bools, strings, None where a number is needed, non-integral floats, NaN,
infinities, negatives and values past :data:`MAX_LIMIT` (4 EiB or 2**62 entries: no cache is that
big, and PostgreSQL's ``BIGINT`` must hold it). Integral floats (``3.0``) and numpy integers are
accepted as the int they are (a linked INT in a ComfyUI graph may arrive as either).

Tested in ``tests/test_cache_limits.py`` (every caller; nothing deleted on a refusal).
"""

from __future__ import annotations

import math
import numbers

EVICTION_POLICIES = ("lru", "lfu")
MAX_LIMIT = 1 << 62


def limit_value(value, name: str) -> int:
    """``value`` as an int in ``[0, MAX_LIMIT]``; ``ValueError`` naming ``name`` for anything else
    (see the module docstring). Strings are refused: the command line converts with
    :func:`parse_limit`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a whole number >= 0, got {_shown(value)}")
    if isinstance(value, numbers.Integral):
        number = int(value)
    else:
        as_float = float(value)
        if not math.isfinite(as_float) or as_float != math.floor(as_float):
            raise ValueError(f"{name} must be a whole number >= 0, got {_shown(value)}")
        number = int(as_float)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}; nothing was deleted")
    if number > MAX_LIMIT:
        raise ValueError(f"{name} is absurdly large ({number} > {MAX_LIMIT}); nothing was deleted")
    return number


def parse_limit(text: str, name: str) -> int:
    """A limit typed on the command line (decimal digits only) as :func:`limit_value`."""
    stripped = str(text).strip()
    if not stripped.isascii() or not stripped.lstrip("-").isdigit():
        raise ValueError(f"{name} must be a whole number >= 0, got {_shown(text)}")
    return limit_value(int(stripped), name)


def check_limits(max_bytes=None, max_entries=None, eviction=None) -> dict:
    """Validate stored limits (None = unchanged); returns them as ints (``ValueError`` otherwise).
    ``max_bytes`` must be >= 1; ``max_entries`` 0 means no entry cap."""
    out = {"max_bytes": None, "max_entries": None, "eviction": None}
    if max_bytes is not None:
        out["max_bytes"] = limit_value(max_bytes, "max_bytes")
        if out["max_bytes"] < 1:
            raise ValueError("max_bytes must be >= 1 (a stored cap of 0 bytes would empty the cache at every write)")
    if max_entries is not None:
        out["max_entries"] = limit_value(max_entries, "max_entries")
    if eviction is not None:
        if not isinstance(eviction, str) or eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {_shown(eviction)}")
        out["eviction"] = eviction
    return out


def stored_limits_shown(max_bytes, max_entries, eviction) -> dict:
    """Stored limits as a store shows them (``limits()``, ``stats()["limits"]``): ``max_bytes``,
    ``max_entries`` (None: no entry cap), ``eviction``. Raises ``ValueError`` for a setting that is
    not a valid stored limit (:func:`check_limits`)."""
    valid = check_limits(max_bytes, max_entries, eviction)
    return {"max_bytes": valid["max_bytes"], "max_entries": valid["max_entries"] or None,
            "eviction": valid["eviction"]}


def prune_targets(max_bytes=None, max_entries=None) -> tuple[int | None, int | None]:
    """Validate the targets of one ``prune`` (each None = the stored limit; 0 keeps nothing)."""
    return (None if max_bytes is None else limit_value(max_bytes, "max_bytes"),
            None if max_entries is None else limit_value(max_entries, "max_entries"))


def eviction_caps(stored: dict, max_bytes=None, max_entries=None) -> tuple[int, int | None, str]:
    """What one eviction run keeps: ``(byte cap, entry cap or None for no cap, policy)`` from the
    prune targets given (:func:`prune_targets`) and the stored limits for the others. Raises
    ``ValueError`` for a bad target, and for stored limits that are not valid stored limits (a row
    or setting edited by hand or by another program): the caller then evicts nothing."""
    try:
        valid = check_limits(stored.get("max_bytes"), stored.get("max_entries"), stored.get("eviction"))
    except ValueError as exc:
        raise ValueError(f"the stored limits are invalid ({exc}); nothing is evicted until they are set again "
                         "(set_limits)") from None
    if valid["max_bytes"] is None or valid["eviction"] is None:
        raise ValueError("the stored limits are incomplete; nothing is evicted until they are set again (set_limits)")
    max_bytes, max_entries = prune_targets(max_bytes, max_entries)
    cap_bytes = valid["max_bytes"] if max_bytes is None else max_bytes
    cap_entries = (valid["max_entries"] or None) if max_entries is None else max_entries
    return cap_bytes, cap_entries, valid["eviction"]


def over_caps(count: int, total: int, cap_bytes: int, cap_entries: int | None) -> bool:
    """Whether ``count`` entries of ``total`` bytes exceed the caps of :func:`eviction_caps`."""
    return total > cap_bytes or (cap_entries is not None and count > cap_entries)


def eviction_order(policy: str) -> str:
    """The SQL ``ORDER BY`` columns of a policy's eviction order, first victim first (both stores' tables
    have ``last_used``, ``hits`` and ``id``): ``lru`` the least recently used, ``lfu`` the fewest hits
    (then the least recently used); the older entry on a tie. Raises ``ValueError`` for another policy."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {_shown(policy)}")
    return "last_used, id" if policy == "lru" else "hits, last_used, id"


def pick_victims(candidates, count: int, total: int, cap_bytes: int, cap_entries: int | None) -> list[int]:
    """The ids, in eviction order, of the fewest ``candidates`` (``(id, nbytes)`` rows in
    :func:`eviction_order`) whose removal brings ``count`` entries of ``total`` bytes within the caps of
    :func:`eviction_caps` (all of them when that is not enough)."""
    victims = []
    for entry_id, nbytes in candidates:
        if not over_caps(count, total, cap_bytes, cap_entries):
            break
        victims.append(int(entry_id))
        total -= int(nbytes)
        count -= 1
    return victims


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
