"""Tenant quotas from the --auth file and from etcd (kvstore.master.quota_source)."""

from __future__ import annotations

import pytest

from kvstore.master.quota_source import QuotaSources, etcd_key, parse_tenant_lines
from kvstore.tenants import Quota


def test_tenant_lines_parse_and_refuse_anything_else():
    assert parse_tenant_lines("# c\n\ntenant a objects=3\ntenant b bytes=1KiB share=10%\n", "k") \
        == {"a": Quota(max_objects=3), "b": Quota(max_bytes=1024, share_fraction=0.1)}
    for bad, why in (("client tok", "expected 'tenant NAME"), ("tenant a\ntenant a", "twice"),
                     ("tenant a objects=x", "not a count"), ("tenant a" + " " * 200_000, "at most")):
        with pytest.raises(ValueError, match=why):
            parse_tenant_lines(bad, "k")


def test_etcd_overrides_the_file_per_tenant_and_a_bad_value_keeps_the_last_good_one():
    applied = []
    s = QuotaSources({"a": Quota(max_objects=1), "b": Quota(max_objects=2)}, applied.append)
    assert s.effective() == {"a": Quota(max_objects=1), "b": Quota(max_objects=2)}
    assert s.etcd_value("tenant b objects=5\ntenant c bytes=1MiB\n", "k")
    assert applied[-1] == {"a": Quota(max_objects=1), "b": Quota(max_objects=5),
                           "c": Quota(max_bytes=1 << 20)}
    assert not s.etcd_value("tenant b objects=5\ntenant c bytes=1MiB\n", "k")   # unchanged
    assert not s.etcd_value("tenant b objects=many", "k") and s.etcd["b"].max_objects == 5
    s.file_reloaded({"a": Quota(max_objects=9)})
    assert applied[-1] == {"a": Quota(max_objects=9), "b": Quota(max_objects=5),
                           "c": Quota(max_bytes=1 << 20)}
    assert s.etcd_value("", "k") and applied[-1] == {"a": Quota(max_objects=9)}   # key deleted
    assert etcd_key("prod") == "/kvstore/prod/tenants"
