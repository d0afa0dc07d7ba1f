"""The C copy loop (``tensorferry._memcpy``), or None where it was not built.

Read as ``_native.loop`` at call time, so a test can turn it off in one place.
"""

from __future__ import annotations

import logging
from types import ModuleType

loop: ModuleType | None
try:
    from . import _memcpy as loop
except ImportError:  # installed without a C compiler: Python loops, slower per run
    loop = None
    logging.getLogger("tensorferry").warning(
        "tensorferry.copy._memcpy was not built (no C compiler when tensorferry was installed): copies of many small "
        "tensors and dtype conversions take slower Python paths; install a C compiler and reinstall tensorferry"
    )
