"""Kernel tests run Triton kernels on the CPU through its interpreter.

The variable must be set before triton is first imported, hence here.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
