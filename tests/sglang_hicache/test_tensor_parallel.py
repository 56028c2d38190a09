"""Two tensor-parallel ranks in two processes (gloo on a file rendezvous), each with SGLang's
own controller and the Redis backend (tp_rank.py): each rank keeps its own share of a page
(MHA) or rank 0 alone writes the shared page (MLA), and SGLang's MIN over the ranks makes both
load the prefix that every rank has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent


def run_ranks(tmp_path: Path, model_dir: Path, extra: dict[str, Any], mla: bool,
              drop_rank: int) -> list[dict[str, Any]]:
    procs, outs = [], []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    for rank in range(2):
        out = tmp_path / f"rank{rank}.json"
        spec = {"rank": rank, "world": 2, "init_file": str(tmp_path / "rendezvous"),
                "model_dir": str(model_dir), "workdir": str(tmp_path), "extra": extra,
                "mla": mla, "out": str(out), "drop_rank": drop_rank}
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(HERE / "tp_rank.py"),
                                        json.dumps(spec)], stdout=log, stderr=log, env=env),
                      log))
        outs.append(out)
    for proc, log in procs:
        try:
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        tail = (tmp_path / f"rank{rank}.log").read_text()[-3000:]
        assert proc.returncode == 0, f"rank {rank} failed:\n{tail}"
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_two_ranks_min_prefix(tmp_path: Path, sglang: Path, redis_url: str, key_prefix: str,
                              mla: bool) -> None:
    extra = {"remote_url": redis_url, "key_prefix": key_prefix, "model_fingerprint": "test"}
    # MHA: rank 1 loses its share of page 2; MLA: the one shared copy of page 2 goes
    reports = run_ranks(tmp_path, sglang, extra, mla, drop_rank=1 if not mla else 0)
    if mla:  # rank 1 is not a storage writer: SGLang skips its backup (acked, 0 tokens)
        assert [r["backed_up"] for r in reports] == [64, 0]
        assert [r["written"] for r in reports] == [4, 0]
        assert {r["geometry"] for r in reports} == {"mla.page-first.bfloat16.p16.r1x2304"}
    else:
        assert [r["backed_up"] for r in reports] == [64, 64]
        assert [r["written"] for r in reports] == [4, 4]
        assert [r["geometry"].split(".")[4] for r in reports] == ["tp0of2", "tp1of2"]
    assert [r["loaded"] for r in reports] == [32, 32]  # the MIN over the ranks: 2 pages
    assert all(r["equal"] for r in reports)
