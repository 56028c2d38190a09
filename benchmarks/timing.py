"""Medians of repetitions, and the rows of the result table."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(
    fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None, warmup: int = 1
) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs (``setup()`` before each, untimed)."""
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        if i >= warmup:
            times.append(took)
    return statistics.median(times)


@dataclasses.dataclass
class Row:
    section: str
    name: str
    value: float
    unit: str
    note: str = ""

    def cell(self) -> str:
        if self.unit in ("GB/s", "x"):
            return f"{self.value:.2f}"
        if self.unit == "ratio":
            return f"{self.value:.3f}"
        if self.unit == "ms":
            return f"{self.value:.2f}" if self.value < 100 else f"{self.value:.0f}"
        if self.unit == "MiB":
            return f"{self.value:.0f}"
        return f"{self.value:.3g}"


class Results:
    """Collects rows in order, prints each as it comes."""

    def __init__(self, echo: bool = True) -> None:
        self.rows: list[Row] = []
        self.echo = echo

    def add(self, section: str, name: str, value: float, unit: str, note: str = "") -> Row:
        row = Row(section, name, value, unit, note)
        self.rows.append(row)
        if self.echo:
            print(f"  [{section}] {name}: {row.cell()} {unit} {note}", flush=True)
        return row

    def get(self, section: str, name: str) -> float:
        for row in self.rows:
            if row.section == section and row.name == name:
                return row.value
        raise KeyError((section, name))
