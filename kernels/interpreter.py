"""Whether Triton runs in its interpreter: below dispatch.py and the Triton kernels, which both ask."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """Triton's interpreter (numpy, one program after another) is on: the kernels' launchers pick
    interpreter-safe settings (fp32 dots, wide programs)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
