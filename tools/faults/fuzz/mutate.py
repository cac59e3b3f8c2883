"""Mutation primitives shared by the input generators: bytes, integers, keys.

Every function takes the caller's :class:`random.Random` and nothing else
random, so a generator seeded the same way makes the same inputs in every
process (no ``hash()``, no time, no ``os.urandom``).
"""

from __future__ import annotations

import random

U64_MAX = 2**64 - 1

#: Integers at the edges of the fields the surfaces decode (u8 .. u64, signed views).
BOUNDARY_INTS = (0, 1, 2, 7, 8, 255, 256, 511, 512, 513, 4095, 4096, 4097, 65535, 65536,
                 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, U64_MAX)

#: Keys every generator draws from besides random ones: the run puts them at its
#: start (see :mod:`.runner`), so valid-looking inputs also hit real objects.
POOL_KEYS = tuple(f"fuzz-pool/{i}" for i in range(16))

_UNICODE_BITS = ("\u00e9", "\u4e2d\u6587", "\U0001f600", "\u202e", "\ufeff", "\x00", "\n",
                 "\t", "\u0301", "\uffff", "/", "..", "%00", " ", "\\")


def boundary_int(rng: random.Random, max_value: int = U64_MAX) -> int:
    """An edge value not above ``max_value`` (or that value, or one past it)."""
    pick = rng.random()
    if pick < 0.15:
        return max_value
    if pick < 0.25 and max_value < U64_MAX:
        return max_value + 1
    return rng.choice([v for v in BOUNDARY_INTS if v <= max_value])


def small_or_boundary(rng: random.Random, small_max: int, max_value: int = U64_MAX,
                      p_boundary: float = 0.15) -> int:
    """Mostly a small value (0..small_max), sometimes an edge one."""
    if rng.random() < p_boundary:
        return boundary_int(rng, max_value)
    return rng.randint(0, small_max)


def pick_case(rng: random.Random, cases: tuple[tuple[str, int], ...]) -> str:
    """One case name of ``cases`` ((name, weight) pairs), drawn by weight."""
    return rng.choices([c for c, _ in cases], [w for _, w in cases])[0]


def random_bytes(rng: random.Random, max_len: int, min_len: int = 0) -> bytes:
    return rng.randbytes(rng.randint(min_len, max_len))


def flip_bits(rng: random.Random, data: bytes, max_flips: int = 8) -> bytes:
    """``data`` with 1..max_flips random bits flipped (empty data stays empty)."""
    if not data:
        return data
    out = bytearray(data)
    for _ in range(rng.randint(1, max_flips)):
        i = rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def mutate_bytes(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """One structure-blind mutation of ``data``: (its name, the result)."""
    how = rng.choice(("flip", "truncate", "insert", "delete", "overwrite", "duplicate",
                      "byte_edge"))
    n = len(data)
    if how == "flip" or n == 0:
        return "flip", flip_bits(rng, data) if n else rng.randbytes(1)
    i = rng.randrange(n)
    if how == "truncate":
        return how, data[:i]
    if how == "insert":
        return how, data[:i] + random_bytes(rng, 16, 1) + data[i:]
    if how == "delete":
        return how, data[:i] + data[i + rng.randint(1, 16):]
    if how == "overwrite":
        chunk = random_bytes(rng, 8, 1)
        return how, data[:i] + chunk + data[i + len(chunk):]
    if how == "duplicate":
        j = rng.randint(i, n)
        return how, data[:j] + data[i:j] + data[j:]
    return how, data[:i] + bytes([rng.choice((0, 1, 0x7F, 0x80, 0xFF))]) + data[i + 1:]


def fuzz_text(rng: random.Random, max_chars: int = 64) -> str:
    """A short string mixing ASCII with awkward code points (NUL, RTL, emoji, combining)."""
    parts = []
    for _ in range(rng.randint(0, 8)):
        if rng.random() < 0.5:
            parts.append(rng.choice(_UNICODE_BITS))
        else:
            parts.append("".join(chr(rng.randint(0x21, 0x7E)) for _ in range(rng.randint(1, 8))))
    return "".join(parts)[:max_chars]


def fuzz_key(rng: random.Random) -> str:
    """A key for a request: a pool key, a fresh ordinary one, empty, huge, or odd unicode."""
    pick = rng.random()
    if pick < 0.35:
        return rng.choice(POOL_KEYS)
    if pick < 0.6:
        return f"fuzz/{rng.getrandbits(48):012x}"
    if pick < 0.68:
        return ""
    if pick < 0.76:
        return "k" * rng.choice((511, 512, 513, 1024, 8192, 65536))
    if pick < 0.88:
        return "fuzz/" + fuzz_text(rng)
    # Lone surrogates cannot be encoded; keep them escaped as the peer would see raw bytes.
    return "fuzz/" + rng.randbytes(rng.randint(1, 32)).decode("utf-8", errors="replace")


def fuzz_key_bytes(rng: random.Random) -> bytes:
    """Key bytes on the wire: a key's UTF-8, or bytes that are not UTF-8 at all."""
    if rng.random() < 0.85:
        return fuzz_key(rng).encode("utf-8", errors="surrogatepass")
    return b"fuzz/" + rng.choice((b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"\x80" * 3,
                                  rng.randbytes(8)))
