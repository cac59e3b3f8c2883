"""The node's native key map (kvstore/native/key_map.cpp) against a dict."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore._native import KeyMap
from kvstore.store.objects import StoredObject

HEX = "0123456789abcdef" * 2


class Table:
    """A slots list, a KeyMap over it and the dict it must agree with."""

    def __init__(self):
        self.slots: list[StoredObject | None] = []
        self.map = KeyMap(self.slots)
        self.want: dict[str, StoredObject] = {}

    def enter(self, key: str) -> StoredObject:
        rec = StoredObject(key, len(self.slots), 64, 0, None, slot=len(self.slots))
        self.slots.append(rec)
        self.map[key] = rec
        self.want[key] = rec
        return rec

    def leave(self, key: str) -> None:
        rec = self.want.pop(key)
        del self.map[key]
        self.slots[rec.slot] = None

    def check(self, probes=()) -> None:
        assert len(self.map) == len(self.want)
        for key in [*self.want, *probes]:
            assert self.map.get(key) is self.want.get(key)
            assert (key in self.map) == (key in self.want)
        assert sorted(self.map.keys()) == sorted(self.want)
        assert {id(r) for r in self.map.values()} == {id(r) for r in self.want.values()}


keys = st.one_of(
    st.binary(min_size=16, max_size=16).map(bytes.hex),            # kept as 16 bytes
    st.text(max_size=40),                                           # kept as strings
    st.sampled_from([HEX, HEX.upper(), HEX[:31], HEX[:16], "", "k", "\x00" * 16]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), keys), max_size=300))
def test_the_map_agrees_with_a_dict(ops):
    t = Table()
    for add, key in ops:
        if add and key not in t.want:
            t.enter(key)
        elif not add and key in t.want:
            t.leave(key)
    t.check(probes=[key for _, key in ops] + [HEX.upper(), HEX[:31]])


def test_many_keys_grow_and_shrink_every_part():
    t = Table()
    names = [(i * 0x9E3779B97F4A7C15 % (1 << 128)).to_bytes(16, "little").hex()
             for i in range(20_000)]
    for key in names:
        t.enter(key)
    for key in names[::3]:
        t.leave(key)
    t.check(probes=names[:50])
    assert t.map.nbytes() < 64 * len(names)


def test_a_record_enters_only_under_its_own_key_at_its_own_slot():
    t = Table()
    rec = t.enter(HEX)
    with pytest.raises(ValueError):
        t.map["other"] = rec                  # not its key
    stray = StoredObject("stray", 1, 1, 0, None, slot=0)
    with pytest.raises(ValueError):
        t.map["stray"] = stray                # slots[0] is another record
    with pytest.raises(ValueError):
        t.map["x"] = "not a record"
    with pytest.raises(TypeError):
        t.map.get(b"bytes")
    with pytest.raises(KeyError):
        t.map["absent"]
    with pytest.raises(KeyError):
        del t.map["absent"]
    assert 7 not in t.map and t.map.get("absent", 5) == 5
    t.check()


def test_a_hex_key_and_its_other_spellings_are_different_keys():
    t = Table()
    t.enter(HEX)
    t.enter(HEX.upper())                      # a string: not the bytes of HEX
    t.check(probes=[HEX[:31] + "F"])
    t.leave(HEX)
    t.check(probes=[HEX])


def test_a_str_subclass_is_the_same_key_as_its_plain_str():
    calls = []

    class Key(str):
        def __hash__(self):          # the map hashes a str as a str, whatever its class says
            calls.append(self)
            return 7

    slots: list[StoredObject | None] = []
    m = KeyMap(slots)
    for i, key in enumerate((Key(HEX), Key("not hex"))):
        slots.append(StoredObject(key, i, 64, 0, None, slot=i))
        m[key] = slots[i]
    assert slots[0]._key_form & 1                      # kept as its 16 bytes
    assert m[HEX] is slots[0] and m[Key(HEX)] is slots[0] and Key(HEX) in m
    assert m["not hex"] is slots[1] and m.get(Key("not hex")) is slots[1]
    m["not hex"] = slots[1]                            # the same key: replaced, not added
    assert len(m) == 2 and not calls
