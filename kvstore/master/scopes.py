"""A scoped caller's view of a master shard: other tenants' keys do not exist for it.

A token bound to tenants (:mod:`kvstore.tenants`) that names another
tenant's key in a Lookup, Exists or Remove is answered exactly as for a key
that never existed: NotFound (False for Exists), never PERMISSION_DENIED,
which would confirm the key. The index does the same probe for that key as
for a miss (:meth:`ObjectIndex.hidden`), so the time of the answer tells
nothing either. A List shows the caller's tenants' keys only. The servicer
calls these only for scoped callers: an admin, a node, and every caller of a
master without ``--auth`` take the unscoped path, at no cost.

Everything here is pure: the index's methods are passed in.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvstore.tenants import DEFAULT_TENANT, Scope
from kvstore.types import ObjectMeta

#: The largest page a scoped List asks of the index at once (a scoped caller's
#: keys may be few among many: the page grows fourfold per scan up to this).
MAX_SCAN_PAGE = 100_000


def hidden_positions(scope: Scope, keys: Sequence[str]) -> list[int]:
    """The positions of ``keys`` outside ``scope`` (none at all for an unscoped caller)."""
    if scope.everything:
        return []
    allows = scope.allows
    return [i for i, key in enumerate(keys) if not allows(key)]


def merge_hidden(keys: Sequence[str], hidden: Sequence[int],
                 answer: Callable[[list[str]], list], hide: Callable[[list[str]], list]) -> list:
    """Per key of ``keys`` in order: ``answer``'s result for the visible ones,
    ``hide``'s (the answer to a key that never existed) for the ``hidden`` positions."""
    hidden_set = set(hidden)
    shown = iter(answer([k for i, k in enumerate(keys) if i not in hidden_set]))
    masked = iter(hide([keys[i] for i in hidden]))
    return [next(masked) if i in hidden_set else next(shown) for i in range(len(keys))]


def _narrowed(scope: Scope, prefix: str) -> str | None:
    """A prefix that selects exactly the keys of ``prefix`` a single-tenant scope
    may see ("": none of them), or None where no prefix says it (the default tenant,
    several tenants)."""
    if scope.tenants is None or len(scope.tenants) != 1:
        return None
    (tenant,) = scope.tenants
    if tenant == DEFAULT_TENANT:
        return None
    own = f"@{tenant}/"
    if prefix.startswith(own):
        return prefix
    return own if own.startswith(prefix) else ""


def list_scoped(list_page: Callable[[str, str, int], tuple[list[ObjectMeta], str]],
                scope: Scope, prefix: str, start_after: str,
                limit: int) -> tuple[list[ObjectMeta], str]:
    """A List page of the keys ``scope`` may see: (at most ``limit`` (0: 1000)
    objects in key order after ``start_after``, the next cursor or "").

    ``list_page`` is :meth:`ObjectIndex.list`. The cursor is always a key of
    the page (never another tenant's key, which would name it).
    """
    limit = limit or 1000
    narrowed = _narrowed(scope, prefix)
    if narrowed is not None:
        if not narrowed:                        # the prefix is another tenant's
            return [], ""
        return list_page(narrowed, start_after, limit)
    out: list[ObjectMeta] = []
    after, ask = start_after, limit
    while True:
        page, cursor = list_page(prefix, after, ask)
        for meta in page:
            if scope.allows(meta.key):
                out.append(meta)
                if len(out) > limit:
                    return out[:limit], out[limit - 1].key
        if not cursor:
            return out, ""
        after, ask = cursor, min(ask * 4, MAX_SCAN_PAGE)
