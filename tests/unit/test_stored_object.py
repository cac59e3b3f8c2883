"""StoredObject's compact layout: one copy without a list, flags in one int, extras on demand."""

from __future__ import annotations

import gc
import sys

import pytest

from kvstore._native import Allocation
from kvstore.store.objects import KEY_BYTES, PARENT_BYTES, ObjectState, StoredObject


def obj(**kw) -> StoredObject:
    return StoredObject("k", 7, 64, 0xFEED, None, **kw)


def test_copies_by_level_with_a_list_only_while_two_or_more():
    o = obj()
    assert o.copy(0) is None and o.copy_items() == [] and o.best_level() is None
    o.set_copy(0, "dram")
    assert o.copy(0) == "dram" and o.copy(2) is None and o.alloc == "dram"
    assert not isinstance(o._copy, list)
    o.set_copy(2, "ssd")
    assert o.copy_items() == [(0, "dram"), (2, "ssd")] and o.best_level() == 0
    assert isinstance(o._copy, list)
    o.set_copy(0, None)
    assert o.copy_items() == [(2, "ssd")] and o.best_level() == 2 and o.alloc is None
    assert not isinstance(o._copy, list)
    o.set_copy(1, None)            # no copy there: nothing changes
    assert o.copy_items() == [(2, "ssd")]
    o.set_copy(2, None)
    assert o.copy_items() == []
    assert StoredObject("k", 1, 1, 1, None, [None, "gpu", None]).copy_items() == [(1, "gpu")]


def test_flags_and_state_are_independent():
    o = obj(state=ObjectState.COMPLETE, confirmed=True)
    o.set_copy(3, "x")
    assert o.state is ObjectState.COMPLETE and o.confirmed and not o.staged
    for name in ("staged", "doomed", "moving", "promoting"):
        setattr(o, name, True)
        assert getattr(o, name)
    o.state = ObjectState.WRITING
    o.doomed = False
    assert o.state is ObjectState.WRITING and not o.doomed and o.moving and o.confirmed
    assert o.copy(3) == "x"        # the copy's level survives flag changes


def test_pins_and_lookahead_are_extras_set_on_demand():
    o = obj(state=ObjectState.COMPLETE)
    o.set_copy(0, "dram")
    assert o._extra is None and o.hard_pins == 0 and o.protect_until_s == 0.0
    assert o.can_give_up(0, soft_ok=False, now=10.0)
    o.soft_pin_until_s = 20.0
    assert not o.can_give_up(0, soft_ok=False, now=10.0) and o.can_give_up(0, True, 10.0)
    o.hard_pins += 1
    assert not o.can_give_up(0, True, 10.0)
    o.hard_pins -= 1
    o.protect_until_s = 15.0
    assert not o.can_give_up(0, True, 10.0) and o.can_give_up(0, True, 30.0)
    o.refs = 1
    assert not o.can_give_up(0, True, 30.0)
    o.refs = 0
    o.moving = True
    assert not o.can_give_up(0, True, 30.0)
    assert not obj(state=ObjectState.COMPLETE).can_give_up(0, True, 30.0)   # no copy there


def test_the_object_itself_is_small():
    # 12 fields, the DRAM copy and two 16-byte keys inline (main: 184, and a key string)
    assert sys.getsizeof(obj()) <= 128


HEX = "0123456789abcdef" * 2


def test_a_hex_key_and_parent_are_kept_as_their_bytes():
    o = StoredObject("".join([HEX[:16], HEX[16:]]), 7, 64, 0, HEX[::-1])
    assert o._key_form == KEY_BYTES | PARENT_BYTES
    assert o.key == HEX and o.parent == HEX[::-1] and type(o.key) is str
    for key in (HEX.upper(), HEX[:31], HEX + "0", "k", HEX[:31] + "g", HEX[:31] + "\u00e9"):
        o.key = key                                  # any other key: kept as its string
        assert o.key == key and not o._key_form & KEY_BYTES
    o.parent = None
    assert o.parent is None and o._key_form == 0
    with pytest.raises(TypeError):
        o.key = None
    with pytest.raises(TypeError):
        o.parent = b"bytes"
    assert o.key == HEX[:31] + "\u00e9"            # a refused value changed nothing


def test_the_object_is_not_tracked_by_the_cyclic_gc():
    o = obj()
    assert not gc.is_tracked(o) and isinstance(o, StoredObject)
    assert type(o).__name__ == "StoredObject" and type(o).__module__ == "kvstore.store.objects"


def test_a_dram_copy_is_kept_inline_and_handed_out_equal():
    o = obj()
    alloc = Allocation(4096, 64, 128, 77)
    o.set_copy(0, alloc)
    assert o._copy is None                                  # no Allocation object kept
    got = o.copy(0)
    assert got == alloc and got.serial == 77 and got.reserved_bytes == 128
    o.set_copy(2, "ssd")
    assert o.copy_items() == [(0, alloc), (2, "ssd")] and o.best_level() == 0
    assert not isinstance(o._copy, list)                    # DRAM is not in the list
    o.set_copy(0, None)
    assert o.copy(0) is None and o.copy_items() == [(2, "ssd")]


def test_an_extent_that_does_not_fit_inline_is_kept_as_it_is():
    o = obj()
    other = Allocation(0, 65, 128, 3)            # not size_bytes long: kept as an object
    o.set_copy(0, other)
    assert o._copy is other and o.copy(0) is other
    o.set_copy(0, Allocation(0, 64, 64, 4))      # the inline copy replaces it
    assert o._copy is None and o.copy(0).serial == 4
    o.set_copy(0, "dram")                        # and is replaced by any other
    assert o.copy(0) == "dram" and o.copy_items() == [(0, "dram")]


def test_a_chained_block_shares_its_parents_key_string():
    """(A key that is not 32 hex characters: those are kept as bytes, no string.)"""
    from kvstore.keys import value_checksum
    from kvstore.store.node import StoreNode
    from kvstore.store.tiers.dram import DramTier

    tier = DramTier(1 << 16)
    try:
        node = StoreNode(tier, policy="default")
        head = "".join(["head-", "of-chain"])            # built at run time: not interned
        for key, parent in ((head, None), ("tail", "".join(["head-", "of-chain"]))):
            obj, _ = node.begin_write(key, 1, 4, value_checksum(b"data"), parent=parent)
            node.write_view(obj)[:] = b"data"
            node.commit_write(obj)
        tail = node._table.objects["tail"]
        assert tail.parent == head and tail.parent is node._table.objects[head].key
    finally:
        tier.close()
