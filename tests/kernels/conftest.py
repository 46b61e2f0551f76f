"""Kernel tests run every Triton kernel in Triton's CPU interpreter and compare it with its torch reference.

``TRITON_INTERPRET=1`` must be set before the kernels are defined (our Triton modules are imported lazily, on
first use, so setting it here at collection time is enough).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
