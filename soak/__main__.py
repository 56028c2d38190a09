"""`python -m soak [--minutes M] [--mode fault-free|faults|both] [--json PATH]`."""

from __future__ import annotations

import sys

from soak.cli import main

sys.exit(main())
