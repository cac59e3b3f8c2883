"""Leader election of a master shard through an etcd lease.

Each shard may run several master processes (a leader and standbys). They
compete for one key, ``/kvstore/<cluster>/shard/<id>/leader``, written with a
lease in a transaction that only succeeds while the key does not exist. The
winner renews its lease; when it stops (dead, hung, partitioned), etcd
deletes the key as the lease expires, and a standby's next campaign wins.

Safety (never two leaders serving one shard): a leader serves only until
``renewed_at + ttl - margin``, where ``renewed_at`` is when it *sent* the
last keepalive that etcd acknowledged. etcd cannot expire the lease before
``renewed_at + ttl``, so no standby can win before the old leader has
stopped serving by its own clock, even when etcd hangs or the leader
process was stopped (SIGSTOP) and resumed: it checks the deadline on every
request, before answering.

Talks to etcd's v3 JSON gateway (``/v3/...``) with urllib: no gRPC or
protobuf dependency on etcd's own stubs.

Thread safety: :class:`Election` runs its own thread; ``is_leader()`` and
``term`` are read from any thread (a float and an int, replaced whole).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


class EtcdError(RuntimeError):
    """etcd did not answer, or answered with an error."""


class Etcd:
    """Minimal etcd v3 client over the JSON gRPC gateway.

    Args:
        url: ``http://host:port`` of one etcd member.
        timeout_s: per request.
    """

    def __init__(self, url: str, timeout_s: float = 1.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except (OSError, urllib.error.URLError, ValueError) as exc:
            raise EtcdError(f"etcd {path}: {exc}") from exc

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; returns (lease id, granted ttl in s)."""
        r = self.call("/v3/lease/grant", {"TTL": ttl_s})
        if "ID" not in r:
            raise EtcdError(f"lease grant: {r}")
        return int(r["ID"]), int(r.get("TTL", ttl_s))

    def keepalive(self, lease_id: int) -> int:
        """Renew; returns the remaining ttl in s (0: the lease is gone)."""
        r = self.call("/v3/lease/keepalive", {"ID": lease_id})
        return int(r.get("result", {}).get("TTL", 0) or 0)

    def revoke(self, lease_id: int) -> None:
        self.call("/v3/lease/revoke", {"ID": lease_id})

    def create_if_absent(self, key: str, value: str, lease_id: int) -> tuple[bool, str, int]:
        """Put ``key`` with the lease unless it exists.

        Returns:
            (won, current value, revision of the store after the transaction).
        """
        k = _b64(key)
        r = self.call("/v3/kv/txn", {
            "compare": [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease_id)}}],
            "failure": [{"request_range": {"key": k}}],
        })
        revision = int(r.get("header", {}).get("revision", 0))
        if r.get("succeeded"):
            return True, value, revision
        kvs = (r.get("responses") or [{}])[0].get("response_range", {}).get("kvs", [])
        current = base64.b64decode(kvs[0]["value"]).decode() if kvs else ""
        return False, current, revision

    def get(self, key: str) -> str:
        r = self.call("/v3/kv/range", {"key": _b64(key)})
        kvs = r.get("kvs", [])
        return base64.b64decode(kvs[0]["value"]).decode() if kvs else ""

    def put(self, key: str, value: str) -> None:
        self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def get_prefix(self, prefix: str) -> dict[str, str]:
        """Every key under ``prefix``, with its value."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)      # the range [prefix, end)
        r = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
                for kv in r.get("kvs", [])}


class Election:
    """Campaign for one shard's leadership and hold it while etcd renews it.

    Args:
        etcd_url: etcd endpoint.
        cluster: name space of the keys (one etcd may serve several clusters).
        shard_id: the shard.
        address: this master's address (the leader key's value).
        ttl_s: lease ttl asked for (etcd may grant more).
        margin_s: a leader stops serving this long before its lease could expire.
    """

    def __init__(self, etcd_url: str, cluster: str, shard_id: int, address: str,
                 ttl_s: int = 3, margin_s: float = 0.5):
        self.etcd = Etcd(etcd_url, timeout_s=min(1.0, ttl_s / 3))
        self.key = f"/kvstore/{cluster}/shard/{shard_id}/leader"
        self.address = address
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self.term = 0                  # +1 each time this process becomes leader
        self.etcd_ok_at = time.monotonic()   # last etcd answer (start: grace of 2 ttls)
        self.term_revision = 0         # etcd revision of the winning transaction
        self._leader_seen = ""         # the leader's address, as last seen (see leader_hint)
        self._deadline = 0.0           # monotonic: serve until then
        self._lease = 0
        self._ttl = ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
        if self._lease and self.is_leader():
            try:   # hand over at once instead of after the ttl
                self.etcd.revoke(self._lease)
            except EtcdError:
                pass
        self._deadline = 0.0

    def is_leader(self) -> bool:
        return time.monotonic() < self._deadline

    @property
    def leader_hint(self) -> str:
        """The shard leader's address as last seen, for refusals ("" when unknown).
        Never this master's own once it stopped leading (its lease not renewed in
        time): a master that stepped down does not send clients back to itself."""
        seen = self._leader_seen
        return "" if seen == self.address and not self.is_leader() else seen

    def etcd_reachable(self) -> bool:
        """Whether etcd answered within the last two lease ttls (a standby that cannot
        reach it could never take over: not ready)."""
        return time.monotonic() - self.etcd_ok_at < 2 * max(self.ttl_s, 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.is_leader():
                    self._renew()
                else:
                    self._campaign()
                self.etcd_ok_at = time.monotonic()
            except EtcdError as exc:
                log.warning("election: %s", exc)
            except Exception:      # a bug or a malformed answer: keep campaigning, loudly
                log.exception("election round failed")
            self._stop.wait(0.3 if not self.is_leader() else max(0.1, self._ttl / 6))

    def _campaign(self) -> None:
        if self._lease:
            self._lease = 0            # a lease we could not renew in time: never reuse it
        sent = time.monotonic()
        lease, ttl = self.etcd.grant(self.ttl_s)
        won, current, revision = self.etcd.create_if_absent(self.key, self.address, lease)
        if not won:
            self._leader_seen = current
            try:
                self.etcd.revoke(lease)
            except EtcdError:
                pass                   # it expires on its own
            return
        self._lease, self._ttl = lease, ttl
        self.term_revision = revision
        self.term += 1
        self._leader_seen = self.address
        self._deadline = sent + ttl - self.margin_s
        log.info("shard leader: %s won %s (lease %x, ttl %d s, term %d)", self.address, self.key,
                 lease, ttl, self.term)

    def _renew(self) -> None:
        sent = time.monotonic()
        try:
            left = self.etcd.keepalive(self._lease)
        except EtcdError:
            if not self.is_leader():
                log.warning("shard leader %s: lease not renewed in time: stepping down",
                            self.address)
            raise
        if left <= 0:
            log.warning("shard leader %s: lease expired: stepping down", self.address)
            self._deadline = 0.0
            return
        if sent < self._deadline:      # renewed while still leader: extend
            self._deadline = sent + min(left, self._ttl) - self.margin_s
        if not self.is_leader():
            log.warning("shard leader %s: lease not renewed in time: stepping down", self.address)
