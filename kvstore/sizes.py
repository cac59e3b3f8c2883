"""Byte sizes: on the command line (``64KiB``, ``4MiB``, ``1GiB``, ``1000``), and the
one rule of a value too large to keep (:func:`check_fits`), which each layer that
decides it applies to its own bound: a store node to its largest object, the SDK
to the largest of the nodes a grant offers, the master's repair to a target's."""

from __future__ import annotations

import re

from kvstore.errors import TooLarge

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """Bytes in ``text`` (binary units KiB/MiB/GiB, decimal KB/MB/GB).

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 64KiB, 4MiB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(size_bytes: int) -> str:
    """Human-readable binary size, e.g. ``1.5 MiB``."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size_bytes} B"


def fits(size_bytes: int, max_object_bytes: int) -> bool:
    """Whether a value of ``size_bytes`` may ever be kept where at most
    ``max_object_bytes`` fit (a node's largest object: under its high watermark)."""
    return size_bytes <= max_object_bytes


def check_fits(size_bytes: int, max_object_bytes: int, where: str, key: str | None = None) -> None:
    """Raises TooLarge unless :func:`fits`; ``where`` names the bound in the message
    (e.g. "this node", "any granted node").

    Raises:
        TooLarge: ``size_bytes`` is above ``max_object_bytes``.
    """
    if not fits(size_bytes, max_object_bytes):
        raise TooLarge(f"{size_bytes} B exceeds the largest object {where} keeps, "
                       f"{max_object_bytes} B (an object must fit under a tier's high "
                       f"watermark)", key=key)
