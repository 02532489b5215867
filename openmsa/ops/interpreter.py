"""Triton's CPU interpreter (``TRITON_INTERPRET=1``, for tests): whether it can run the kernels.

Triton decides at import time whether kernels are compiled or interpreted, so the environment
variable must be set before anything imports triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

_interpreter_works = False


@triton.jit
def _loaded_loop_bound_kernel(BOUND, OUT):
    count = 0
    for _ in range(0, tl.load(BOUND)):  # the kernels' loops run to bounds read from memory
        count += 1
    tl.store(OUT, count)


def check_interpreter() -> None:
    """Raises a ``RuntimeError`` that says what to install where this Triton's interpreter
    cannot run loops whose bounds are loaded values (Triton 3.6 turns such a bound into an
    int with ``int(array)``, which numpy 2.4 made an error), instead of an ``InterpreterError``
    from deep inside a kernel. The probe runs once per process."""
    global _interpreter_works
    if not _interpreter_works:
        probe_loaded_loop_bounds()
        _interpreter_works = True


def probe_loaded_loop_bounds(kernel=_loaded_loop_bound_kernel) -> None:
    """Runs ``kernel`` (a 3-trip loop to a loaded bound) under the interpreter; raises a
    ``RuntimeError`` naming the fix if it fails or counts wrong."""
    bound = torch.tensor([3], dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    try:
        kernel[(1,)](bound, count)
    except Exception as error:  # the interpreter wraps the numpy error in its own type
        import numpy

        raise RuntimeError(
            f"Triton {triton.__version__}'s CPU interpreter cannot run openmsa's kernels with "
            f"numpy {numpy.__version__} ({type(error).__name__}: {error}); install "
            "'numpy<2.4' (the project's test and train extras pin it)") from error
    if int(count) != 3:
        raise RuntimeError(f"Triton {triton.__version__}'s CPU interpreter ran a 3-trip loop "
                           f"{int(count)} times")
