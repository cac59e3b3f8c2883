"""The OpenAI front takes a request's tenant from the caller's token (docs/tenants.md):
a token bound to one tenant makes its requests that tenant's KV; the conductor and the
prefill engine make that tenant's keys."""

from __future__ import annotations

import asyncio
import secrets

import aiohttp
import pytest

from kvstore._proto import serving_pb2 as spb
from kvstore.auth import TokenFile
from kvstore.client.models import namespace_for_model
from kvstore.conductor.http import ByteTokenizer, HttpFront
from kvstore.errors import InvalidArgument
from kvstore.keys import prefix_keys, tenant_namespace, valid_tenant
from kvstore.rpc import ServerSecurity

TOKENS = {name: f"{name}-{secrets.token_hex(16)}" for name in ("acme", "ab", "plain", "admin")}


class Recorder:
    """A backend that records what it is asked and answers one token."""

    def __init__(self):
        self.requests: list[spb.GenerateRequest] = []

    async def generate(self, request):
        self.requests.append(request)
        yield spb.GenerateChunk(tokens=[65])
        yield spb.GenerateChunk(done=True, metrics=spb.RequestMetrics())

    async def status(self):
        return spb.ConductorStatus()


def test_the_front_sets_the_tenant_of_a_single_tenant_token(tmp_path):
    auth = tmp_path / "tokens"
    auth.write_text(f"client {TOKENS['acme']} tenants=acme\nclient {TOKENS['ab']} tenants=a,b\n"
                    f"client {TOKENS['plain']}\nadmin {TOKENS['admin']}\n")
    backend = Recorder()

    async def run():
        front = HttpFront(backend, "m", ByteTokenizer(256),
                          security=ServerSecurity(tokens=TokenFile(str(auth))))
        port = await front.start()
        try:
            async with aiohttp.ClientSession() as s:
                for name in ("acme", "ab", "plain", "admin"):
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                      json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 1},
                                      headers={"Authorization": f"Bearer {TOKENS[name]}"}) as r:
                        assert r.status == 200, await r.text()
        finally:
            await front.stop()
    asyncio.run(run())
    assert [r.tenant for r in backend.requests] == ["acme", "", "", ""]


def test_a_tenants_namespace_makes_its_keys():
    ns = namespace_for_model("tiny", 4)
    assert tenant_namespace(ns, "") is ns and tenant_namespace(ns, "default") is ns
    keys = prefix_keys(list(range(8)), tenant_namespace(ns, "acme"))
    assert all(k.startswith("@acme/") for k in keys)
    assert [k.split("/", 1)[1] for k in keys] != prefix_keys(list(range(8)), ns)
    assert valid_tenant("") and valid_tenant("acme") and not valid_tenant("a b")
    with pytest.raises(InvalidArgument):
        tenant_namespace(ns, "a/b")
