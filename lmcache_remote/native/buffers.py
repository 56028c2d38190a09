"""Buffer addresses: where a byte view's memory starts, to tell views of the same bytes apart
from copies (a part received in place) and to hand a view to a C function.

`address` is the one way the package asks: the C extension's ``address`` where it was built
(`native.wire`), numpy's otherwise; the same number either way, 0 for an empty view.
"""

from __future__ import annotations

import numpy as np

from lmcache_remote.native import wire as _native


def address(view: memoryview) -> int:
    """Where a byte view's memory starts (0 for an empty one)."""
    if not len(view):
        return 0
    if _native is not None:
        return int(_native.address(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
