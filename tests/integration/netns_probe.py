"""Try every port of a secured multi-host cluster with bad credentials (run on host e).

    python netns_probe.py CLUSTER_JSON TOKENS_JSON

CLUSTER_JSON is :meth:`~kvstore.tools.cluster.multihost.MultiHost.describe`'s;
TOKENS_JSON maps role -> token. TLS files come from ``$KVSTORE_TLS_*``.
Prints one JSON object: check name -> what the server answered (a gRPC
status name, an error class name, an HTTP status, or "ok").
"""

from __future__ import annotations

import json
import ssl
import sys
import urllib.error
import urllib.request

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.errors import KVStoreError
from kvstore.rpc import CHANNEL_OPTIONS, ClientCredentials, channel
from kvstore.tls import TlsFiles, client_context
from kvstore.transfer.protocol import Op
from kvstore.transfer.tcp import NodeConnection

WRONG = "client-" + "0" * 32


def grpc_answer(address: str, token: str | None, call, plaintext: bool = False) -> str:
    tls = TlsFiles.client_from_env()
    ch = (grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if plaintext
          else channel(address, ClientCredentials(token=token, tls=tls)))
    with ch:
        try:
            call(ch)
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name


def data_answer(address: str, token: str | None, tls: ssl.SSLContext | None) -> str:
    host, port = address.rsplit(":", 1)
    try:
        conn = NodeConnection(host, int(port), timeout_s=5, token=token, tls=tls)
        try:
            conn.call(Op.PING, "")
            return "ok"
        finally:
            conn.close()
    except KVStoreError as exc:
        return type(exc).__name__


def http_answer(url: str, token: str | None, ctx: ssl.SSLContext | None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return str(resp.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        return type(exc).__name__


def main() -> None:
    cluster = json.load(open(sys.argv[1]))
    tokens = json.load(open(sys.argv[2]))
    files = TlsFiles.client_from_env()
    tls = client_context(files) if files else None
    out: dict[str, str] = {}

    def stat(ch):
        pb_grpc.MasterStub(ch).Stat(pb.StatRequest(), timeout=5)

    def evict(ch):
        pb_grpc.MasterStub(ch).Remove(pb.RemoveRequest(keys=["w-0"], reason="evict"), timeout=5)

    for shard in cluster["shards"]:
        for m in shard:
            a = m["address"]
            out[f"master {a} anonymous"] = grpc_answer(a, None, stat)
            out[f"master {a} wrong token"] = grpc_answer(a, WRONG, stat)
            out[f"master {a} client: Stat"] = grpc_answer(a, tokens["client"], stat)
            out[f"master {a} client: evict"] = grpc_answer(a, tokens["client"], evict)
            out[f"master {a} plaintext"] = grpc_answer(a, tokens["admin"], stat, plaintext=True)
    for name, node in cluster["nodes"].items():
        a = node["address"]
        out[f"node {name} anonymous"] = data_answer(a, None, tls)
        out[f"node {name} wrong token"] = data_answer(a, WRONG, tls)
        out[f"node {name} plaintext"] = data_answer(a, tokens["client"], None)
        out[f"node {name} client"] = data_answer(a, tokens["client"], tls)
    stubs = {"prefill0": lambda ch: spb_grpc.PrefillEngineStub(ch).Status(
                 spb.EngineStatusRequest(), timeout=5),
             "decode0": lambda ch: spb_grpc.DecodeEngineStub(ch).Status(
                 spb.EngineStatusRequest(), timeout=5)}
    targets = [(n, cluster["engines"][n], call) for n, call in stubs.items()]
    targets.append(("conductor", cluster["conductor"], lambda ch: spb_grpc.ConductorStub(
        ch).Status(spb.ConductorStatusRequest(), timeout=5)))
    for name, a, call in targets:
        out[f"{name} anonymous"] = grpc_answer(a, None, call)
        out[f"{name} wrong token"] = grpc_answer(a, WRONG, call)
        out[f"{name} node role"] = grpc_answer(a, tokens["node"], call)
        out[f"{name} client"] = grpc_answer(a, tokens["client"], call)
    url = f"https://{cluster['http']}/v1/models"
    out["http anonymous"] = http_answer(url, None, tls)
    out["http wrong token"] = http_answer(url, WRONG, tls)
    out["http node role"] = http_answer(url, tokens["node"], tls)
    out["http client"] = http_answer(url, tokens["client"], tls)
    out["http plaintext"] = http_answer(f"http://{cluster['http']}/v1/models", tokens["client"],
                                        None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
