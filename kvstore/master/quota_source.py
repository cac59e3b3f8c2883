"""Where a master shard's tenant quotas come from: the ``--auth`` file, and etcd.

    --auth FILE                   ``tenant NAME ...`` lines, again on SIGHUP
    etcd /kvstore/CLUSTER/tenants the same lines as one value (with ``--etcd``), read
                                  every :data:`POLL_S`; a tenant named there takes its
                                  quota from there, the others from the file

so an operator changes every shard's hard limits at once, without a signal to
each process::

    etcdctl put /kvstore/CLUSTER/tenants "$(printf 'tenant beta bytes=100MiB\\n')"
    etcdctl del /kvstore/CLUSTER/tenants          # back to the file's quotas

A value that does not parse is refused (logged once, naming the line) and the
last good one stays in force; an unreachable etcd changes nothing. Nodes take
their guaranteed shares from their own ``--auth`` file only (docs/tenants.md).

Thread safety: the master's event loop; etcd is read in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from kvstore import tenants as tn

log = logging.getLogger(__name__)

#: How often the etcd key is read (s).
POLL_S = 2.0
#: The largest value taken from etcd (bytes): MAX_TENANTS lines of about 100 bytes.
MAX_VALUE_BYTES = 128 * 1024


def etcd_key(cluster: str) -> str:
    """The etcd key of a cluster's tenant quotas."""
    return f"/kvstore/{cluster}/tenants"


def parse_tenant_lines(text: str, source: str) -> dict[str, tn.Quota]:
    """``tenant NAME [bytes=SIZE] [objects=N] [share=SIZE|PCT%]`` lines (``#`` comments,
    blank lines) as tenant -> quota.

    Raises:
        ValueError: a line that is not a tenant line, a bad field, a tenant named twice,
            more than MAX_TENANTS lines, or a value over MAX_VALUE_BYTES.
    """
    if len(text.encode()) > MAX_VALUE_BYTES:
        raise ValueError(f"{source}: {len(text.encode())} bytes, at most {MAX_VALUE_BYTES}")
    out: dict[str, tn.Quota] = {}
    for where, parts in tn.config_lines(text, source):
        if parts[0].lower() != "tenant":
            raise ValueError(f"{where}: expected 'tenant NAME [bytes=SIZE] [objects=N] "
                             f"[share=SIZE|PCT%]'")
        tn.add_quota(out, parts[1:], where)
    return out


class QuotaSources:
    """The file's quotas and etcd's; :meth:`effective` is what the shard enforces.

    Args:
        file_quotas: the ``--auth`` file's ``tenant`` lines.
        apply: called with the effective quotas whenever either source changes.
    """

    def __init__(self, file_quotas: dict[str, tn.Quota], apply: Callable[[dict], None]):
        self.file = dict(file_quotas)
        self.etcd: dict[str, tn.Quota] = {}
        self.apply = apply
        self._etcd_text = ""            # the last value read (good or not)

    def effective(self) -> dict[str, tn.Quota]:
        return {**self.file, **self.etcd}

    def file_reloaded(self, quotas: dict[str, tn.Quota]) -> None:
        """The ``--auth`` file was read again (SIGHUP)."""
        self.file = dict(quotas)
        self.apply(self.effective())

    def etcd_value(self, text: str, source: str) -> bool:
        """A value read from etcd ("" when the key is absent); returns whether the
        quotas changed. A value that does not parse keeps the last good one."""
        if text == self._etcd_text:
            return False
        self._etcd_text = text
        try:
            quotas = parse_tenant_lines(text, source)
        except ValueError as exc:
            log.error("tenant quotas in etcd not taken, keeping the last good ones: %s", exc)
            return False
        self.etcd = quotas
        log.info("tenant quotas from etcd %s: %d tenant(s)", source, len(quotas))
        self.apply(self.effective())
        return True

    async def follow_etcd(self, etcd, cluster: str, period_s: float = POLL_S) -> None:
        """Read the cluster's etcd key every ``period_s`` until cancelled (an
        :class:`~kvstore.master.election.Etcd` client; errors keep the last quotas)."""
        key = etcd_key(cluster)
        while True:
            try:
                text = await asyncio.to_thread(etcd.get, key)
            except Exception as exc:      # noqa: BLE001 - etcd down: nothing changes
                log.debug("tenant quotas: etcd %s not read: %s", key, exc)
            else:
                self.etcd_value(text, key)
            await asyncio.sleep(period_s)
