"""RESP front inputs: valid commands, then broken framing, huge lengths and junk.

An input is the raw bytes sent on one fresh connection to ``kvstore resp``
(the driver may authenticate first with a role's token, ``auth``), after
which the driver shuts its sending side and reads every reply to the end.
The run's tokens appear as placeholders (``@@client@@``) the driver fills
in. Cases (``RespInput.kind``)::

    valid         1-8 well-formed commands (GET/SET/MGET/EXISTS/DEL/SCAN/INFO/HELLO/...)
                  with fuzzed keys and values, multibulk or inline
    pipeline      50-2,000 commands in one write (PING, ECHO, GET)
    truncated     a valid frame cut anywhere
    lengths       *<n> / $<len> lines with huge, negative or non-numeric counts
    mutated       a valid frame with bits flipped, bytes cut or repeated
    inline        long or quoted inline lines, unbalanced quotes, NULs
    auth          AUTH / HELLO AUTH with a wrong, another role's or no token
    random        random bytes
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstore.tools.faults.fuzz.mutate import fuzz_key_bytes, mutate_bytes, pick_case, random_bytes

#: Placeholder -> role whose token the driver puts there.
TOKEN_MARK = b"@@%s@@"
_VERBS = (b"GET", b"SET", b"MGET", b"MSET", b"EXISTS", b"DEL", b"STRLEN", b"GETRANGE", b"TYPE",
          b"TTL", b"SETNX", b"SCAN", b"INFO", b"DBSIZE", b"PING", b"ECHO", b"HELLO", b"SELECT",
          b"CLIENT", b"COMMAND", b"CONFIG", b"MEMORY", b"KVSTORE.PIN", b"KVSTORE.INSPECT",
          b"KEYS", b"NOSUCH")        # no FLUSHALL: it would remove the checker's references


@dataclass(frozen=True, slots=True)
class RespInput:
    kind: str
    auth: str            # role to AUTH as before sending ("" none)
    data: bytes

    def fingerprint(self) -> bytes:
        return self.kind.encode() + b"\0" + self.auth.encode() + b"\0" + self.data


def frame(args: list[bytes]) -> bytes:
    """A multibulk command."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class RespGenerator:
    """Deterministic RESP inputs (see the module docstring)."""

    CASES = (("valid", 30), ("pipeline", 4), ("truncated", 12), ("lengths", 12),
             ("mutated", 18), ("inline", 8), ("auth", 6), ("random", 10))

    def __init__(self, rng: random.Random):
        self.rng = rng

    def next(self) -> RespInput:
        case = pick_case(self.rng, self.CASES)
        return getattr(self, f"_{case}")()

    def _role(self) -> str:
        return self.rng.choice(("client", "client", "admin", ""))

    def command(self) -> list[bytes]:
        rng = self.rng
        verb = rng.choice(_VERBS)
        key = b"fuzz:" + fuzz_key_bytes(rng)[:40] if rng.random() < 0.8 else fuzz_key_bytes(rng)
        value = random_bytes(rng, rng.choice((0, 1, 16, 4096, 70_000)))
        args = {b"SET": [key, value] + rng.choice(([], [b"NX"], [b"XX"], [b"EX", b"10"],
                                                   [b"KEEPTTL"], [b"BOGUS"])),
                b"MSET": [key, value, key + b"2", value[:5]],
                b"SETNX": [key, value], b"GETRANGE": [key, b"0", b"-1"],
                b"SCAN": [b"0", b"MATCH", b"fuzz:*", b"COUNT", b"5"],
                b"HELLO": [rng.choice((b"2", b"3", b"4", b"x"))],
                b"SELECT": [rng.choice((b"0", b"1", b"-1"))], b"ECHO": [value[:64]],
                b"CLIENT": [rng.choice((b"ID", b"GETNAME", b"SETNAME", b"LIST"))],
                b"COMMAND": [rng.choice((b"COUNT", b"DOCS", b"INFO", b"X"))],
                b"CONFIG": [b"GET", rng.choice((b"*", b"save", b"maxmemory*"))],
                b"MEMORY": [b"USAGE", key], b"INFO": [], b"DBSIZE": [], b"PING": [],
                b"KEYS": [b"fuzz:*"]}.get(verb, [key])
        if rng.random() < 0.1:
            args = args[:rng.randrange(len(args) + 1)]          # wrong arity
        return [verb] + args

    def _valid(self) -> RespInput:
        rng = self.rng
        cmds = [self.command() for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.2:
            data = b"".join(b" ".join(c[:2]).replace(b"\r", b"").replace(b"\n", b"") + b"\r\n"
                            for c in cmds)
        else:
            data = b"".join(frame(c) for c in cmds)
        return RespInput(f"valid:{cmds[0][0].decode().lower()}", self._role(), data)

    def _pipeline(self) -> RespInput:
        rng = self.rng
        one = rng.choice((frame([b"PING"]), frame([b"PING"]), frame([b"GET", b"fuzz:k"]),
                          b"PING\r\n", frame([b"ECHO", b"e"])))
        return RespInput("pipeline", "client", one * rng.randint(50, 2000))

    def _truncated(self) -> RespInput:
        data = frame(self.command())
        return RespInput("truncated", self._role(), data[:self.rng.randrange(max(1, len(data)))])

    def _lengths(self) -> RespInput:
        rng = self.rng
        n = rng.choice((b"99999999999999999999", b"4294967296", b"-1", b"-9", b"1048577",
                        b"536870913", b"x", b"", b"1e3", b"0x10", b" 3", b"9" * 40))
        how = rng.choice(("array", "bulk", "bare", "unsent"))
        data = {"array": b"*" + n + b"\r\n", "bulk": b"*2\r\n$3\r\nGET\r\n$" + n + b"\r\nabc\r\n",
                "bare": b"*1\r\n$" + n + b"\r\n",
                "unsent": b"*1\r\n$536870912\r\n" + b"v" * 4096}[how]
        return RespInput(f"lengths:{how}", self._role(), data)

    def _mutated(self) -> RespInput:
        how, data = mutate_bytes(self.rng, frame(self.command()))
        return RespInput(f"mutated:{how}", self._role(), data)

    def _inline(self) -> RespInput:
        rng = self.rng
        data = rng.choice((b"SET k \"unbalanced\r\n", b"GET 'a\r\n", b"A" * 70_000,
                           b"SET \"a\\x4\" b\r\n", b"\x00\x00PING\r\n", b"   \r\n\r\nPING\r\n",
                           b"ECHO " + b"x" * 60_000 + b"\r\n", b"SET \"a\"b c\r\n"))
        return RespInput("inline", self._role(), data)

    def _auth(self) -> RespInput:
        rng = self.rng
        token = rng.choice((TOKEN_MARK % b"client", TOKEN_MARK % b"admin", b"wrong" * 5, b""))
        data = rng.choice((frame([b"AUTH", token]), frame([b"AUTH", b"admin", token]),
                           frame([b"HELLO", b"3", b"AUTH", b"client", token]),
                           frame([b"AUTH", b"a", b"b", b"c"])))
        return RespInput("auth", "", data + frame(self.command()))

    def _random(self) -> RespInput:
        return RespInput("random", self._role(), random_bytes(self.rng, 4096, 1))
