"""Human formatting helpers: sizes, durations, tables."""

from __future__ import annotations

from rich.table import Table


def size(nbytes: int | float | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def seconds(value: float | None, none: str = "-") -> str:
    if value is None:
        return none
    s = int(value)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def table(*columns: str, title: str | None = None) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        numeric = col in {"entries", "bytes", "size", "tokens", "parts", "worker", "world",
                          "idle", "ttl"}
        t.add_column(col, justify="right" if numeric else "left")
    return t
