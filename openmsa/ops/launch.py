"""Launching the Triton kernels: stride lists, and a fallback to one pipeline stage where the
stages do not fit this GPU's shared memory."""

from __future__ import annotations

from triton.runtime.errors import OutOfResources


def strides(*tensors):
    return [stride for t in tensors for stride in (t.stride(0), t.stride(1))]


# Configurations whose pipeline stages did not fit this GPU's shared memory (small GQ with wide
# head dims: a tile of 64 tokens carries a 64-row index query), remembered so that they are not
# compiled again.
_ONE_STAGE: set = set()


def launch(kernel, grid, *args, num_warps, num_stages, one_stage=_ONE_STAGE, **constants):
    """``kernel[grid](...)``, falling back to one pipeline stage (the same kernel without
    overlapped loads) when ``num_stages`` exceeds the shared memory; other errors propagate.
    ``one_stage``: the set that remembers such configurations."""
    key = (kernel.fn.__name__, num_warps, tuple(sorted(constants.items())))
    if num_stages > 1 and key not in one_stage:
        try:
            return kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constants)
        except OutOfResources:
            one_stage.add(key)
    return kernel[grid](*args, num_warps=num_warps, num_stages=1, **constants)
