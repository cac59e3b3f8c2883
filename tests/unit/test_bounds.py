"""The bounds each layer checks with one helper (issue 32): a put's replica count
(kvstore.rpc.check_replica_num) and a value too large to keep (kvstore.sizes)."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument, TooLarge
from kvstore.rpc import MAX_REPLICAS, check_replica_num
from kvstore.sizes import check_fits, fits


def test_replica_num_is_one_to_max_or_unset_where_a_wire_field_may_be():
    for n in (1, MAX_REPLICAS):
        check_replica_num(n)
    check_replica_num(0, unset_ok=True)
    for n, unset_ok in ((0, False), (-1, True), (MAX_REPLICAS + 1, True)):
        with pytest.raises(InvalidArgument, match=r"replica_num must be in") as info:
            check_replica_num(n, unset_ok=unset_ok, key="k")
        assert info.value.key == "k"


def test_a_value_fits_up_to_the_largest_object_and_is_too_large_above():
    assert fits(100, 100) and not fits(101, 100)
    check_fits(100, 100, "this node")
    with pytest.raises(TooLarge, match="101 B exceeds the largest object this node keeps, 100 B"):
        check_fits(101, 100, "this node", key="k")
