"""Importing a snapshot, shared by `import` and `warm --from`: verify, then write, with bars."""

from __future__ import annotations

import os

from lmcache_remote_cli.context import CliContext
from lmcache_remote_cli.output import size

from lmcache_remote.admin import TransferResult


def import_file(cx: CliContext, path: str, *, skip_existing: bool, pin: bool = False
                ) -> TransferResult:
    """Verify the whole file (nothing is written if it is damaged), then import it (and with
    `pin`, pin its chunks)."""
    total = os.path.getsize(path)
    with cx.progress(f"verifying {os.path.basename(path)}", total, unit="bytes") as advance:
        info = cx.admin.verify(path, advance)
    label = "warming" if skip_existing else "importing"
    with cx.progress(label, info.value_bytes, unit="bytes") as advance:
        return cx.admin.import_(path, skip_existing=skip_existing, verify=False,
                                progress=advance, pin=pin)


def report_transfer(cx: CliContext, file: str, result: TransferResult, done: str) -> None:
    """The outcome of `export` / `import`: the JSON document, or one line such as
    ``exported 3 entries (96.0 KiB) to FILE`` (``done`` is "exported to", "imported from")."""
    if cx.json:
        cx.emit({"file": file, "entries": result.chunks, "bytes": result.bytes,
                 "skipped": result.skipped})
        return
    verb, preposition = done.split()
    cx.out.print(f"{verb} {result.chunks} entries ({size(result.bytes)}) {preposition} {file}",
                 markup=False)
