"""Byte sizes on the command line: ``64KiB``, ``4MiB``, ``1GiB``, ``1000``."""

from __future__ import annotations

import re

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
