"""HTTP front inputs: valid OpenAI requests, then mutated JSON, framing and headers.

An input is the raw bytes of one HTTP/1.1 request and how to send it
(``mode``): ``normal`` (send, read the answer, keep the connection),
``half_close`` (send, shut the sending side, read every answer to the end:
for bytes that are not one complete request, which the server may wait on),
``slow`` (send a part, hold the connection open a short while without
finishing, in the background: slowloris), ``early_close`` (send, read the
status line, close before the body is done: a streamed completion whose
client goes away). The run's tokens appear as placeholders
(``@@client@@``) that the driver fills in, so the bytes are reproducible.
Cases (``HttpInput.kind``)::

    valid:<route>      POST /v1/completions (token ids or text, max_tokens 1-2, streamed
                       or not), GET /v1/models, GET /health
    json:<how>         a completions body with a field of the wrong type, a huge or
                       negative number, an unknown field, nesting, a 10,000-digit integer,
                       NaN, a top-level non-object, invalid UTF-8, not JSON at all
    framing:<how>      broken chunked encoding, Content-Length negative / not a number /
                       larger or smaller than the body / twice, both CL and chunked,
                       a bad request line, a bare LF, pipelined requests
    headers:<how>      one oversized header, too many headers, a bad Authorization
                       (none, unknown token, another role, malformed), odd methods / paths
    slow               a request cut short and held open
    early_close        a streamed completion closed after its first bytes
    random             random bytes
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from kvstore.tools.faults.fuzz.mutate import fuzz_text, mutate_bytes, pick_case, random_bytes

#: Placeholder -> role whose token the driver puts there.
TOKEN_MARK = b"@@%s@@"
MODEL = "tiny"
VOCAB = 2048          # the tiny model's vocabulary (kvstore.client.models)


@dataclass(frozen=True, slots=True)
class HttpInput:
    kind: str
    mode: str           # "normal", "half_close", "slow" or "early_close"
    request: bytes

    def fingerprint(self) -> bytes:
        return self.kind.encode() + b"\0" + self.mode.encode() + b"\0" + self.request


def _request(method: str, path: str, body: bytes | None = None, auth: str | None = "client",
             headers: tuple[tuple[str, str], ...] = (), content_length: str | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz"]
    if auth is not None:
        lines.append("Authorization: Bearer " + (TOKEN_MARK % auth.encode()).decode())
    if body is not None:
        lines += ["Content-Type: application/json",
                  f"Content-Length: {len(body) if content_length is None else content_length}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")


class HttpGenerator:
    """Deterministic HTTP inputs (see the module docstring)."""

    CASES = (("valid", 12), ("json", 40), ("framing", 16), ("headers", 18), ("slow", 2),
             ("early_close", 2), ("random", 10))

    def __init__(self, rng: random.Random):
        self.rng = rng

    def next(self) -> HttpInput:
        case = pick_case(self.rng, self.CASES)
        return getattr(self, f"_{case}")()

    def completion_body(self, stream: bool = False) -> dict:
        rng = self.rng
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] if rng.random() < 0.6 \
            else fuzz_text(rng, 24) or "hi"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 2)}
        if stream:
            body["stream"] = True
        return body

    def _valid(self) -> HttpInput:
        rng = self.rng
        route = rng.choice(("completions", "completions", "models", "health"))
        if route == "models":
            return HttpInput("valid:models", "normal", _request("GET", "/v1/models"))
        if route == "health":
            return HttpInput("valid:health", "normal", _request("GET", "/health", auth=None))
        body = json.dumps(self.completion_body(stream=rng.random() < 0.3)).encode()
        return HttpInput("valid:completions", "normal", _request("POST", "/v1/completions", body))

    def _json(self) -> HttpInput:
        rng = self.rng
        body = self.completion_body()
        how = rng.choice(("wrong_type", "huge_number", "negative", "unknown_field", "nested",
                          "many_digits", "nan", "not_object", "bad_utf8", "not_json", "mutated",
                          "batch", "vocab", "empty"))
        field = rng.choice(("model", "prompt", "max_tokens", "stream", "n", "stop", "stream_options",
                            "logit_bias", "echo", "temperature"))
        raw: bytes | None = None
        if how == "wrong_type":
            body[field] = rng.choice((5, 2.5, None, True, "x", [], {}, [[]], [None], {"a": 1}))
        elif how == "huge_number":
            body[field if field != "model" else "max_tokens"] = rng.choice(
                (2**31, 2**63, 2**64 + 1, 10**30, 1e308))
        elif how == "negative":
            body[rng.choice(("max_tokens", "n", "temperature"))] = rng.choice((-1, -2**63, 0))
        elif how == "unknown_field":
            body[rng.choice(("tools", "images", "messages", "functions", fuzz_text(rng, 16)))] = 1
        elif how == "nested":
            depth = rng.choice((50, 1000, 100_000))
            raw = (b'{"model": "tiny", "max_tokens": 1, "prompt": ' + b"[" * depth
                   + b"1" + b"]" * depth + b"}")
        elif how == "many_digits":
            raw = b'{"model": "tiny", "prompt": [1], "max_tokens": ' + b"9" * rng.choice(
                (4301, 10_000)) + b"}"
        elif how == "nan":
            raw = b'{"model": "tiny", "prompt": [1], "max_tokens": ' + rng.choice(
                (b"NaN", b"Infinity", b"-Infinity", b"1e999")) + b"}"
        elif how == "not_object":
            raw = rng.choice((b"[]", b"null", b"1", b'"x"', b"true", b"[{}]"))
        elif how == "bad_utf8":
            raw = b'{"model": "tiny", "prompt": "' + rng.choice((b"\xff\xfe", b"\xc3", b"\xed\xa0\x80")) \
                + b'", "max_tokens": 1}'
        elif how == "not_json":
            raw = rng.choice((b"", b"{", b"{'model': 'tiny'}", b"model=tiny", random_bytes(rng, 64)))
        elif how == "mutated":
            raw = mutate_bytes(rng, json.dumps(body).encode())[1]
        elif how == "batch":
            body["prompt"] = [[rng.randrange(VOCAB)] for _ in range(rng.choice((2, 3, 65, 1000)))]
        elif how == "vocab":
            body["prompt"] = [rng.choice((-1, VOCAB, 2**31, 2**63))]
        else:
            body = rng.choice(({}, {"model": MODEL}, {"model": MODEL, "prompt": ""},
                               {"model": MODEL, "prompt": []}, {"model": "other", "prompt": [1]}))
        data = raw if raw is not None else json.dumps(body).encode()
        return HttpInput(f"json:{how}", "normal", _request("POST", "/v1/completions", data))

    def _framing(self) -> HttpInput:
        rng = self.rng
        body = json.dumps(self.completion_body()).encode()
        how = rng.choice(("chunked_bad", "chunked_ok", "cl_negative", "cl_text", "cl_short",
                          "cl_long", "cl_twice", "cl_and_chunked", "bad_request_line", "bare_lf",
                          "pipelined", "http10", "no_host"))
        head = b"POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\nAuthorization: Bearer @@client@@\r\n"
        if how in ("chunked_bad", "chunked_ok"):
            size = f"{len(body):x}".encode() if how == "chunked_ok" else rng.choice(
                (b"zz", b"-1", b"ffffffffffffffffff", b"", f"{len(body) + 5:x}".encode()))
            tail = b"\r\n0\r\n\r\n" if how == "chunked_ok" or rng.random() < 0.5 else b"\r\n"
            req = head + b"Transfer-Encoding: chunked\r\n\r\n" + size + b"\r\n" + body + tail
        elif how.startswith("cl_"):
            cl = {"cl_negative": "-5", "cl_text": "abc", "cl_short": str(max(0, len(body) - 7)),
                  "cl_long": str(len(body) + rng.choice((1, 100, 10**9))),
                  "cl_twice": f"{len(body)}\r\nContent-Length: {len(body) + 1}",
                  "cl_and_chunked": f"{len(body)}\r\nTransfer-Encoding: chunked"}[how]
            req = head + f"Content-Length: {cl}\r\n\r\n".encode() + body
        elif how == "bad_request_line":
            req = rng.choice((b"POST\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b" / HTTP/1.1\r\n\r\n",
                              b"POST /v1/completions HTTP/1.1 extra\r\n\r\n",
                              b"G\x00T / HTTP/1.1\r\n\r\n"))
        elif how == "bare_lf":
            req = _request("POST", "/v1/completions", body).replace(b"\r\n", b"\n")
        elif how == "pipelined":
            one = _request("GET", "/v1/models")
            req = one * rng.randint(2, 8) + _request("POST", "/v1/completions", body)
        elif how == "http10":
            req = _request("POST", "/v1/completions", body).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        else:
            req = _request("POST", "/v1/completions", body).replace(b"Host: fuzz\r\n", b"")
        return HttpInput(f"framing:{how}", "half_close", req)

    def _headers(self) -> HttpInput:
        rng = self.rng
        body = json.dumps(self.completion_body()).encode()
        how = rng.choice(("oversized", "many", "no_auth", "bogus_token", "node_token",
                          "admin_token", "malformed_auth", "method", "path", "unicode_header"))
        if how == "oversized":
            req = _request("POST", "/v1/completions", body,
                           headers=(("X-Fuzz", "a" * rng.choice((8190, 8191, 65536))),))
        elif how == "many":
            req = _request("GET", "/v1/models",
                           headers=tuple((f"X-F{i}", "v") for i in range(rng.choice((100, 200, 2000)))))
        elif how in ("no_auth", "bogus_token", "node_token", "admin_token"):
            auth = {"no_auth": None, "bogus_token": "nobody", "node_token": "node",
                    "admin_token": "admin"}[how]
            req = _request("POST", "/v1/completions", body, auth=auth)
        elif how == "malformed_auth":
            req = _request("GET", "/v1/models", auth=None, headers=(("Authorization", rng.choice(
                ("Bearer", "Bearer ", "Basic Zm9vOmJhcg==", "bearer  @@client@@x", "@@client@@"))),))
        elif how == "method":
            req = _request(rng.choice(("PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO")),
                           "/v1/completions", body)
        elif how == "path":
            req = _request(rng.choice(("GET", "POST")), rng.choice(
                ("/v1/chat/completions", "/v1/completions/../models", "/" + "a" * 9000, "/%00",
                 "/v1/models?x=" + "%ff" * 50, "*", "/v1//completions")), body)
        else:
            req = _request("GET", "/v1/models", headers=(("X-Fuzz", fuzz_text(rng, 32)),))
        return HttpInput(f"headers:{how}", "normal", req)

    def _slow(self) -> HttpInput:
        req = _request("POST", "/v1/completions", json.dumps(self.completion_body()).encode())
        return HttpInput("slow", "slow", req[:self.rng.randrange(1, len(req))])

    def _early_close(self) -> HttpInput:
        body = self.completion_body(stream=True)
        body["max_tokens"] = self.rng.choice((64, 2048, 3900))   # inside the context: a long stream
        return HttpInput("early_close", "early_close",
                         _request("POST", "/v1/completions", json.dumps(body).encode()))

    def _random(self) -> HttpInput:
        rng = self.rng
        data = random_bytes(rng, 512, 1)
        if rng.random() < 0.5:
            data = b"POST /v1/completions HTTP/1.1\r\n" + data
        return HttpInput("random", "half_close", data)
