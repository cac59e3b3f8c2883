"""kvstore.metrics and kvstore.health without a service: tallies, exposition, the HTTP port."""

from __future__ import annotations

import ssl
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.health import Health, State
from kvstore.metrics import REQUEST_BUCKETS, MetricsServer, ProcessMetrics, RequestTally


def _samples(metrics: ProcessMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(metrics.text().decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_tallies_of_every_thread_sum_into_one_exposition():
    m = ProcessMetrics("node")
    m.observe("Lookup", "OK", 0.0002)
    threads_tallies = [m.tally() for _ in range(4)]

    def work(t: RequestTally):
        for i in range(1000):
            t.observe("get", "OK" if i % 10 else "NOT_FOUND", 0.00003 * (i % 7))

    threads = [threading.Thread(target=work, args=(t,)) for t in threads_tallies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.release(threads_tallies[0])          # a finished connection's tally is folded in
    s = _samples(m)
    counts = {(lab["op"], lab["code"]): v for lab, v in s["kvstore_requests_total"]}
    assert counts == {("Lookup", "OK"): 1, ("get", "OK"): 3600, ("get", "NOT_FOUND"): 400}
    buckets = [(lab["le"], v) for lab, v in s["kvstore_request_duration_seconds_bucket"]
               if lab["op"] == "get"]
    assert buckets[-1] == ("+Inf", 4000)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)     # cumulative
    assert len(buckets) == len(REQUEST_BUCKETS) + 1
    (count,) = [v for lab, v in s["kvstore_request_duration_seconds_count"] if lab["op"] == "get"]
    assert count == 4000
    assert s["kvstore_process_info"] == [({"component": "node"}, 1.0)]


def test_a_failing_collector_does_not_break_the_scrape():
    m = ProcessMetrics("master")
    m.collect(lambda: 1 / 0)
    assert "kvstore_process_info" in _samples(m)


@pytest.mark.parametrize("state,health,ready", [
    (State.STARTING, False, False), (State.SERVING, True, True),
    (State.STANDBY, False, True), (State.DRAINING, False, False)])
def test_health_states(state, health, ready):
    h = Health()
    h.set(state)
    assert (h.serving, h.ready) == (health, ready)


def test_draining_is_final():
    h = Health()
    h.set(State.SERVING)
    h.set(State.DRAINING)
    h.set(State.SERVING)
    assert h.state is State.DRAINING


class _Tokens:
    """A TokenFile's lookup (kvstore.auth), for the port's checks."""

    def __init__(self, table):
        self.table = table

    def role_of(self, token):
        return self.table.get(token)

    def credentials_of(self, token):
        from kvstore.tenants import ALL
        role = self.table.get(token)
        return (role, ALL) if role is not None else None


def _get(url: str, token: str | None = None, context=None) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_port_serves_metrics_health_and_ready_with_tokens():
    from kvstore.auth import Role

    m, h = ProcessMetrics("master"), Health()
    tokens = _Tokens({"a" * 20: Role.ADMIN, "c" * 20: Role.CLIENT, "m" * 20: Role.METRICS})
    server = MetricsServer(m, h, "127.0.0.1", 0, tokens=tokens).start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert _get(base + "/health")[0] == 503 and _get(base + "/ready")[0] == 503
        h.set(State.STANDBY)
        assert _get(base + "/health")[0] == 503 and _get(base + "/ready")[0] == 200
        h.set(State.SERVING)
        code, body = _get(base + "/health")
        assert code == 200 and b"serving" in body
        assert _get(base + "/metrics")[0] == 401
        assert _get(base + "/metrics", "x" * 20)[0] == 401
        assert _get(base + "/metrics", "c" * 20)[0] == 403
        for ok in ("a" * 20, "m" * 20):
            code, body = _get(base + "/metrics", ok)
            assert code == 200 and b"kvstore_process_info" in body
        assert _get(base + "/nope")[0] == 404
    finally:
        server.stop()


def test_the_port_speaks_tls_with_the_service_certificate(tmp_path):
    pytest.importorskip("cryptography")
    from kvstore.tls import TlsFiles
    from kvstore.tools.cluster.certs import make_certs

    certs = make_certs(tmp_path, ["127.0.0.1"])
    m, h = ProcessMetrics("node"), Health()
    h.set(State.SERVING)
    server = MetricsServer(m, h, "127.0.0.1", 0,
                           tls=TlsFiles(str(certs.server_cert), str(certs.server_key),
                                        str(certs.ca))).start()
    try:
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        code, body = _get(f"https://127.0.0.1:{server.port}/metrics", context=ctx)
        assert code == 200 and b"kvstore_process_info" in body      # no client cert asked
        with pytest.raises(OSError):        # plain HTTP to the TLS port: closed
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5)
    finally:
        server.stop()
