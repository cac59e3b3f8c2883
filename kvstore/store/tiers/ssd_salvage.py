"""Quarantine a corrupt SSD directory and start on what it still holds intact.

``kvstore node --ssd-quarantine`` calls :func:`quarantine` when the SSD tier
refuses its directory (:class:`~kvstore.store.tiers.ssd.SsdCorrupt`)::

    DIR                         (truncated data.mdb, or a damaged page)
     | rename, under the directory's flock
     v
    DIR.quarantine-<UTC time>/  kept as it was, for a person to look at, plus a
                                QUARANTINE file saying why
    DIR/                        a fresh environment: every object whose "meta" and
                                "data" records could still be read, copied as they were
                                (checksums checked), and the directory's node id

The records are read with :class:`~kvstore.store.tiers.lmdb_file.LmdbFile`
(plain reads, never a mapping, so no SIGBUS or lmdb assertion can stop the
node), walking both B-trees in key order side by side and skipping damaged
pages. What "meta" counted and could not be copied is counted corrupt
(:attr:`Salvage.corrupt`); when even the main database is unreadable nothing
can be counted, and the log says so. With the newest meta page damaged the
tree of the commit before is read: what the last commit added is lost
unseen.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass

from kvstore.keys import value_checksum
from kvstore.store.tiers.base import TierIOError
from kvstore.store.tiers.lmdb_file import LmdbDamage, LmdbFile
from kvstore.store.tiers.ssd import SsdInUse, SsdTier, parse_meta

log = logging.getLogger(__name__)
_BATCH_BYTES = 64 << 20            # values copied per commit, at most
_BATCH_RECORDS = 4096


@dataclass(frozen=True, slots=True)
class Salvage:
    """What :func:`quarantine` did."""

    moved_to: str       # where the corrupt directory is now
    copied: int         # objects copied into the fresh directory
    corrupt: int        # records "meta" counted that could not be copied intact
    damage: str         # the first damage met ("" none), for the log


def quarantine(path: str, capacity_bytes: int, map_size_bytes: int | None = None,
               reason: str = "") -> tuple[SsdTier, Salvage]:
    """Move the directory ``path`` aside and open a fresh SSD tier there holding
    every object that could be read intact (see the module docstring).

    Args:
        path: the corrupt directory (its tier closed).
        capacity_bytes, map_size_bytes: of the fresh tier (``SsdTier``'s).
        reason: why it is quarantined (the refusal's message), kept in the
            QUARANTINE file.

    Returns:
        The fresh tier (not yet recovered: its ``recover()`` adopts the copies
        and counts the surplus; the corrupt ones are counted in its ``dropped``
        already) and what was done.

    Raises:
        SsdInUse: another process holds ``path``.
        OSError: it cannot be renamed, or the fresh tier made.
    """
    moved_to = _move_aside(path, reason)
    tier = SsdTier(path, capacity_bytes, map_size_bytes)
    try:
        salvage = _copy(os.path.join(moved_to, "data.mdb"), tier, moved_to)
    except BaseException:
        tier.close()
        raise
    tier.note_dropped(salvage.corrupt)
    log.warning("SSD %s was corrupt (%s): moved to %s; %d object(s) copied back intact, "
                "%d lost%s", path, reason or salvage.damage or "no reason given", moved_to,
                salvage.copied, salvage.corrupt,
                f" (first damage met: {salvage.damage})" if salvage.damage else "")
    return tier, salvage


def _move_aside(path: str, reason: str) -> str:
    """Rename ``path`` to a new ``path.quarantine-<time>`` while holding its flock."""
    path = path.rstrip("/")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved_to, n = f"{path}.quarantine-{stamp}", 1
    while os.path.exists(moved_to):
        n += 1
        moved_to = f"{path}.quarantine-{stamp}-{n}"
    fd = os.open(os.path.join(path, "kvstore.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SsdInUse(f"SSD path {path} is in use by another node process") from None
        os.rename(path, moved_to)
    finally:
        os.close(fd)
    with open(os.path.join(moved_to, "QUARANTINE"), "w") as f:
        f.write(f"moved aside by kvstore node --ssd-quarantine at {stamp} from {path}\n"
                f"{reason}\n")
    return moved_to


def _copy(data_file: str, tier: SsdTier, where: str) -> Salvage:
    """Copy every intact object of ``data_file`` into ``tier``."""
    damages: list[str] = []

    def damaged(exc: LmdbDamage) -> None:
        damages.append(str(exc))

    copied = claimed = 0
    try:
        src = LmdbFile(data_file)
    except OSError as exc:
        return Salvage(where, 0, 0, f"{data_file}: {exc}")
    with src:
        try:
            dbs = src.databases()
        except LmdbDamage as exc:
            log.error("SSD salvage: the main database of %s is unreadable (%s): no object "
                      "could be found or counted", data_file, exc)
            return Salvage(where, 0, 0, str(exc))
        meta_db, data_db = dbs.get(b"meta"), dbs.get(b"data")
        owner = _owner(src, dbs, damaged)
        if owner:
            tier.claim(owner)
        if meta_db is None or data_db is None:
            return Salvage(where, 0, 0, "no meta or data database")
        claimed = meta_db.entries
        batch: list[tuple[bytes, bytes, bytes]] = []
        batch_bytes = 0
        values = src.records(data_db, damaged)
        data = next(values, None)
        for slot, meta in src.records(meta_db, damaged):
            while data is not None and data[0] < slot:     # both in key order
                data = next(values, None)
            if data is None or data[0] != slot or data[1] is None or meta is None:
                continue
            parsed = parse_meta(slot, meta)
            value = data[1]
            if parsed is None or len(value) != parsed[1].size_bytes \
                    or value_checksum(value) != parsed[1].checksum:
                continue
            batch.append((slot, value, meta))
            batch_bytes += len(value)
            if batch_bytes >= _BATCH_BYTES or len(batch) >= _BATCH_RECORDS:
                if not _restore(tier, batch):
                    break
                copied += len(batch)
                batch, batch_bytes = [], 0
        if batch and _restore(tier, batch):
            copied += len(batch)
    return Salvage(where, copied, max(0, claimed - copied), damages[0] if damages else "")


def _restore(tier: SsdTier, batch: list) -> bool:
    """Commit one batch of copies; False (logged) when the fresh directory is full."""
    try:
        tier.restore(batch)
        return True
    except TierIOError as exc:
        log.error("SSD salvage stopped: %s", exc)
        return False


def _owner(src: LmdbFile, dbs: dict, damaged) -> str | None:
    info = dbs.get(b"info")
    if info is None:
        return None
    for key, value in src.records(info, damaged):
        if key == b"node_id" and value is not None:
            try:
                return value.decode()
            except UnicodeDecodeError:
                return None
    return None
