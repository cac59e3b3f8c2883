"""A scoped caller's view of a master shard (kvstore.master.scopes, ObjectIndex.hidden):
other tenants' keys answer as keys that never existed, List shows only its tenants."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument, NotFound
from kvstore.master.scopes import hidden_positions, list_scoped, merge_hidden
from kvstore.rpc import ServerSecurity, caller_scope
from kvstore.tenants import ALL, DEFAULT_ONLY, NO_TENANT, Scope
from test_master_index import T0, index, put  # noqa: F401 (index: the fixture)

A = Scope(frozenset({"a"}))
AB = Scope(frozenset({"a", "b"}))


def test_hidden_positions_are_the_keys_outside_the_scope():
    keys = ["@a/1", "@b/1", "plain", "@a/2"]
    assert hidden_positions(ALL, keys) == []
    assert hidden_positions(A, keys) == [1, 2]
    assert hidden_positions(AB, keys) == [2]
    assert hidden_positions(DEFAULT_ONLY, keys) == [0, 1, 3]
    assert hidden_positions(NO_TENANT, keys) == [0, 1, 2, 3]


def test_merge_keeps_the_order_of_the_keys():
    keys = ["k0", "k1", "k2", "k3"]
    out = merge_hidden(keys, [1, 3], lambda ks: [f"shown {k}" for k in ks],
                       lambda ks: [f"hidden {k}" for k in ks])
    assert out == ["shown k0", "hidden k1", "shown k2", "hidden k3"]


def test_another_tenants_key_answers_as_one_that_never_existed(index):  # noqa: F811
    put(index, "@a/exists")
    (hidden,) = index.hidden(["@a/exists"])
    (missing,) = index.lookup(["@a/never"], T0)
    assert isinstance(hidden, NotFound) and isinstance(missing, NotFound)
    assert (hidden.message, hidden.key) == (missing.message, "@a/exists")
    # Nothing changed: the entry's access count is the same, and it is still there.
    (meta,) = index.lookup(["@a/exists"], T0)
    assert meta.access_count == 1 and index.exists(["@a/exists"]) == [True]


def test_hidden_keeps_errors_that_say_nothing_of_existence(index):  # noqa: F811
    out = index.hidden(["", "@a/x"])
    assert isinstance(out[0], InvalidArgument)       # a bad key stays a bad key
    assert isinstance(out[1], NotFound)


def _pages(metas):
    """A fake ObjectIndex.list over sorted keys."""
    keys = sorted(metas)

    def list_page(prefix, start_after, limit):
        sel = [k for k in keys if k.startswith(prefix) and k > start_after]
        page = sel[:limit]
        return ([_Meta(k) for k in page], page[-1] if len(sel) > limit else "")
    return list_page


class _Meta:
    def __init__(self, key):
        self.key = key


@pytest.mark.parametrize("scope, prefix, want", [
    (A, "", ["@a/1", "@a/2", "@a/3"]),
    (A, "@a/2", ["@a/2"]),
    (A, "@", ["@a/1", "@a/2", "@a/3"]),
    (A, "@b/", []),
    (A, "x", []),
    (DEFAULT_ONLY, "", ["p1", "p2"]),
    (AB, "", ["@a/1", "@a/2", "@a/3", "@b/1"]),
])
def test_list_shows_only_the_scopes_keys(scope, prefix, want):
    list_page = _pages(["@a/1", "@a/2", "@a/3", "@b/1", "@c/1", "p1", "p2"])
    got, after = [], ""
    for _ in range(20):                                  # page by page, two at a time
        page, cursor = list_scoped(list_page, scope, prefix, after, 2)
        got += [m.key for m in page]
        assert cursor == "" or cursor == page[-1].key    # never another tenant's key
        if not cursor:
            break
        after = cursor
    assert got == want


def test_the_scope_of_a_call_is_all_without_auth():
    assert caller_scope(None, None) is ALL
    assert caller_scope(None, ServerSecurity()) is ALL


def test_a_put_names_a_parent_of_its_own_tenant_only():
    from kvstore.store.tenancy import own_parent

    assert own_parent("@alpha/c", "@alpha/p") == "@alpha/p"
    assert own_parent("c", "p") == "p"
    assert own_parent("c", "") is None
    # Another tenant's parent is dropped: a chain never crosses tenants.
    assert own_parent("@beta/c", "@alpha/p") is None
    assert own_parent("@beta/c", "p") is None and own_parent("c", "@alpha/p") is None
