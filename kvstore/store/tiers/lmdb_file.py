"""An lmdb data file (``data.mdb``) read as plain bytes: checked before lmdb maps it,
and walked page by page where lmdb cannot go.

Why: lmdb trusts its file. It maps ``data.mdb`` and follows page numbers, so
a file shorter than the last page its meta page records dies of SIGBUS at
the first missing page, and a damaged B-tree page trips an assertion (abort)
in a cursor step, or fails the whole read with ``MDB_CORRUPTED``. This module
reads the file with ``pread`` (a missing page is a short read, never a
fault) to check it before lmdb opens it (:meth:`LmdbFile.check`), and to copy
out the records of a damaged file, skipping what cannot be read
(:meth:`LmdbFile.records`, for ``ssd_salvage``).

The format (lmdb 0.9 on a 64-bit host, ``mdb.c``; integers little-endian)::

    page  | pgno u64 | pad u16 | flags u16 | lower u16 | upper u16 | ptrs u16[n] ... nodes |
           (an overflow page has | pages u32 | where lower, upper are)
    pages 0, 1: meta  | header | magic u32 | version u32 | address u64 | mapsize u64 |
                      | db FREE (48 B) | db MAIN (48 B) | last_pgno u64 | txnid u64 |
          the newer txnid is current; FREE's pad holds the page size
    db    | pad u32 | flags u16 | depth u16 | branch u64 | leaf u64 | overflow u64 |
          | entries u64 | root u64 |            (root ~0: empty)
    node  | lo u16 | hi u16 | flags u16 | ksize u16 | key | data |
          branch: child pgno = lo | hi << 16 | flags << 32; leaf: size = lo | hi << 16,
          data inline, or (flags & BIGDATA) the pgno of its overflow pages;
          MAIN's leaves name the other databases (flags & SUBDATA, data a db record)

A B-tree of depth d has branch pages at its top d - 1 levels and leaves at
the bottom; ``n = (lower - 16) / 2`` nodes per page, keys ascending.
lmdb writes every page it allocates below ``last_pgno + 1``, so a whole file
is at least that many pages long.

Thread safety: one LmdbFile per thread; it only reads.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterator

_HEADER = struct.Struct("<QHHHH")        # pgno, pad, flags, lower, upper
_HEADER_BYTES = 16
_NODE = struct.Struct("<HHHH")           # lo, hi, flags, ksize
_NODE_BYTES = 8
_DB = struct.Struct("<IHHQQQQQ")         # pad, flags, depth, branch, leaf, overflow, entries, root
_META_AT = _HEADER_BYTES                 # the meta record within pages 0 and 1
_MAGIC = 0xBEEFC0DE
_VERSION = 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0x01, 0x02, 0x04, 0x08
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_EMPTY_ROOT = 2**64 - 1
_MIN_PAGE, _MAX_PAGE = 512, 65536


class LmdbDamage(Exception):
    """The file is not what lmdb wrote (truncated, a damaged page); one line saying what."""


@dataclass(frozen=True, slots=True)
class Db:
    """One B-tree (a database of the environment)."""

    depth: int      # levels (0: empty)
    entries: int    # records, as lmdb counted them
    root: int       # root page (_EMPTY_ROOT: none)


@dataclass(frozen=True, slots=True)
class Meta:
    """The current meta page."""

    page_bytes: int     # lmdb's page size
    last_pgno: int      # highest page in use: the file holds at least last_pgno + 1 pages
    txnid: int          # the last committed transaction
    free: Db            # lmdb's free-page list
    main: Db            # the main database, which names the others

    @property
    def need_bytes(self) -> int:
        """The least length of a whole file."""
        return (self.last_pgno + 1) * self.page_bytes


class LmdbFile:
    """Reads one ``data.mdb`` with ``pread``.

    Args:
        path: the data file.

    Raises:
        OSError: it cannot be opened.
    """

    def __init__(self, path: str):
        self.path = path
        self.name = os.path.basename(path)      # for messages
        self._fd = os.open(path, os.O_RDONLY)
        self.size_bytes = os.fstat(self._fd).st_size
        self._meta: Meta | None = None
        self._both_metas = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "LmdbFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the meta pages and the size ----
    def meta(self) -> Meta:
        """The current meta page: of the valid ones, the newer transaction's (lmdb itself
        refuses a file with either invalid: :meth:`check` does too).

        Raises:
            LmdbDamage: page 0 is no meta page (an empty or cut file, not lmdb's).
        """
        if self._meta is None:
            first = self._parse_meta(os.pread(self._fd, _MIN_PAGE, 0))
            if first is None:
                raise LmdbDamage(f"{self.name} ({self.size_bytes} B) has no valid lmdb meta "
                                 f"page: it is empty, cut or not lmdb's")
            second = self._parse_meta(os.pread(self._fd, _MIN_PAGE, first.page_bytes))
            self._both_metas = second is not None
            self._meta = max((m for m in (first, second) if m is not None),
                             key=lambda m: m.txnid)
        return self._meta

    @staticmethod
    def _parse_meta(raw: bytes) -> Meta | None:
        if len(raw) < _META_AT + 24 + 2 * _DB.size + 16:
            return None
        flags = struct.unpack_from("<H", raw, 10)[0]
        magic, version = struct.unpack_from("<II", raw, _META_AT)
        if not flags & _P_META or magic != _MAGIC or version != _VERSION:
            return None
        at = _META_AT + 24
        free = _DB.unpack_from(raw, at)
        main = _DB.unpack_from(raw, at + _DB.size)
        last_pgno, txnid = struct.unpack_from("<QQ", raw, at + 2 * _DB.size)
        page_bytes = free[0]
        if not _MIN_PAGE <= page_bytes <= _MAX_PAGE or page_bytes & (page_bytes - 1):
            return None
        return Meta(page_bytes, last_pgno, txnid, _db(free), _db(main))

    def check_size(self) -> Meta:
        """The current meta page, once the file is checked to be as long as it records.

        Raises:
            LmdbDamage: the file is shorter than lmdb's last page in use (truncated).
        """
        meta = self.meta()
        if self.size_bytes < meta.need_bytes:
            raise LmdbDamage(f"{self.name} is truncated: {self.size_bytes} B, but lmdb's meta "
                             f"page records {meta.need_bytes} B in use (pages 0..{meta.last_pgno}"
                             f" of {meta.page_bytes} B)")
        return meta

    # ---- pages ----
    def _page(self, pgno: int) -> bytes:
        """Page ``pgno``, checked to be one lmdb wrote there.

        Raises:
            LmdbDamage: outside the pages in use, beyond the end of the file, or a
                header that is not that page's.
        """
        meta = self.meta()
        if not 2 <= pgno <= meta.last_pgno:
            raise LmdbDamage(f"page {pgno} is outside the pages in use (2..{meta.last_pgno})")
        raw = os.pread(self._fd, meta.page_bytes, pgno * meta.page_bytes)
        if len(raw) < meta.page_bytes:
            raise LmdbDamage(f"page {pgno} is beyond the end of the file")
        own, _pad, flags, lower, upper = _HEADER.unpack_from(raw)
        if own != pgno:
            raise LmdbDamage(f"page {pgno} is damaged (its header says page {own})")
        if not flags & _P_OVERFLOW and not (
                _HEADER_BYTES < lower <= upper <= meta.page_bytes
                and (lower - _HEADER_BYTES) % 2 == 0):
            raise LmdbDamage(f"page {pgno} is damaged (lower {lower}, upper {upper})")
        return raw

    def _nodes(self, pgno: int, raw: bytes, leaf: bool) -> list[tuple[int, int, int, int]]:
        """(offset, size or child, flags, key size) of every node of a B-tree page.

        Raises:
            LmdbDamage: a node outside its page.
        """
        psize = len(raw)
        lower, upper = struct.unpack_from("<HH", raw, 12)
        out = []
        for at in struct.unpack_from(f"<{(lower - _HEADER_BYTES) // 2}H", raw, _HEADER_BYTES):
            if not upper <= at <= psize - _NODE_BYTES:
                raise LmdbDamage(f"page {pgno} is damaged (a node at {at})")
            lo, hi, flags, ksize = _NODE.unpack_from(raw, at)
            if leaf:
                size = lo | hi << 16
                end = at + _NODE_BYTES + ksize + (8 if flags & _F_BIGDATA else size)
                out.append((at, size, flags, ksize))
            else:
                end = at + _NODE_BYTES + ksize
                out.append((at, lo | hi << 16 | flags << 32, 0, ksize))
            if end > psize:
                raise LmdbDamage(f"page {pgno} is damaged (a node runs past the page)")
        return out

    def _overflow_pgno(self, pgno: int, raw: bytes, node: tuple[int, int, int, int]) -> int:
        """The first overflow page of a leaf node's value, checked to be whole.

        Raises:
            LmdbDamage: its overflow pages are not whole.
        """
        at, size, _flags, ksize = node
        (first,) = struct.unpack_from("<Q", raw, at + _NODE_BYTES + ksize)
        meta = self.meta()
        head = self._page(first)
        _own, _pad, oflags, pages = struct.unpack_from("<QHHI", head)
        if (not oflags & _P_OVERFLOW or first + pages - 1 > meta.last_pgno
                or pages * meta.page_bytes < _HEADER_BYTES + size):
            raise LmdbDamage(f"the overflow pages at {first} (from page {pgno}) are damaged")
        return first

    def _value(self, pgno: int, raw: bytes, node: tuple[int, int, int, int]) -> bytes:
        """A leaf node's data, from its overflow pages where it has them.

        Raises:
            LmdbDamage: its overflow pages are not whole.
        """
        at, size, flags, ksize = node
        start = at + _NODE_BYTES + ksize
        if not flags & _F_BIGDATA:
            return raw[start:start + size]
        first = self._overflow_pgno(pgno, raw, node)
        page_bytes = self.meta().page_bytes
        value = os.pread(self._fd, size, first * page_bytes + _HEADER_BYTES)
        if len(value) < size:
            raise LmdbDamage(f"the overflow pages at {first} run past the end of the file")
        return value

    def leaves(self, db: Db, on_damage: Callable[[LmdbDamage], None] | None = None
               ) -> Iterator[tuple[int, bytes, list[tuple[int, int, int, int]]]]:
        """Every leaf page of ``db`` in key order, as (pgno, page, nodes).

        Args:
            on_damage: called for a damaged page, whose subtree is then skipped;
                None: the damage is raised.

        Raises:
            LmdbDamage: a damaged page, or one reached twice (without ``on_damage``).
        """
        if db.root == _EMPTY_ROOT or db.depth == 0:
            return
        seen: set[int] = set()
        stack = [(db.root, db.depth)]        # only the path to the current leaf, and siblings
        while stack:
            pgno, depth = stack.pop()
            try:
                if pgno in seen:
                    raise LmdbDamage(f"page {pgno} is reached twice")
                seen.add(pgno)
                raw = self._page(pgno)
                kind = struct.unpack_from("<H", raw, 10)[0] & (_P_BRANCH | _P_LEAF | _P_OVERFLOW)
                if kind != (_P_LEAF if depth == 1 else _P_BRANCH):
                    raise LmdbDamage(f"page {pgno} is damaged (type {kind:#x} where a "
                                     f"{'leaf' if depth == 1 else 'branch'} page belongs)")
                nodes = self._nodes(pgno, raw, leaf=depth == 1)
            except LmdbDamage as exc:
                if on_damage is None:
                    raise
                on_damage(exc)
                continue
            if depth == 1:
                yield pgno, raw, nodes
            else:
                stack.extend((child, depth - 1) for _at, child, _f, _k in reversed(nodes))

    # ---- what the environment holds ----
    def databases(self) -> dict[bytes, Db]:
        """The named databases (the main database's records).

        Raises:
            LmdbDamage: the main database cannot be read.
        """
        out: dict[bytes, Db] = {}
        for pgno, raw, nodes in self.leaves(self.meta().main):
            for node in nodes:
                at, size, flags, ksize = node
                key = raw[at + _NODE_BYTES:at + _NODE_BYTES + ksize]
                if flags != _F_SUBDATA or size != _DB.size:
                    raise LmdbDamage(f"page {pgno}: the record of database {key!r} is damaged")
                out[key] = _db(_DB.unpack_from(self._value(pgno, raw, node)))
        return out

    def check(self) -> Meta:
        """Check what lmdb will read, before it maps the file: its length, then every
        branch and leaf page of every database (its place, its type, its nodes
        inside it, no sub-database where none belongs), the overflow pages of every
        value, and each database's record count.

        Returns:
            The current meta page.

        Raises:
            LmdbDamage: the file is truncated or a page is damaged.
        """
        meta = self.check_size()
        if not self._both_metas:
            raise LmdbDamage(f"{self.name}'s second meta page is damaged")
        trees = [(b"<free list>", meta.free), *sorted(self.databases().items())]
        for name, db in trees:
            counted = 0
            for pgno, raw, nodes in self.leaves(db):
                counted += len(nodes)
                for node in nodes:
                    if node[2] & ~_F_BIGDATA:
                        raise LmdbDamage(f"page {pgno} is damaged (node flags {node[2]:#x})")
                    if node[2]:
                        self._overflow_pgno(pgno, raw, node)
            if counted != db.entries:
                raise LmdbDamage(f"database {name.decode(errors='replace')} is damaged: "
                                 f"{counted} records in its pages, {db.entries} recorded")
        return meta

    def records(self, db: Db, on_damage: Callable[[LmdbDamage], None]
                ) -> Iterator[tuple[bytes, bytes | None]]:
        """Every readable (key, value) of ``db`` in key order (value None: the key was
        read, its value is damaged). Damage goes to ``on_damage`` and is skipped."""
        for pgno, raw, nodes in self.leaves(db, on_damage):
            for node in nodes:
                at, _size, _flags, ksize = node
                key = raw[at + _NODE_BYTES:at + _NODE_BYTES + ksize]
                try:
                    yield key, self._value(pgno, raw, node)
                except LmdbDamage as exc:
                    on_damage(exc)
                    yield key, None


def _db(fields: tuple) -> Db:
    _pad, _flags, depth, _branch, _leaf, _overflow, entries, root = fields
    return Db(depth, entries, root)
