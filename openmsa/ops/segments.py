"""The key-outer kernels (dK/dV, the KL's d index_k) write fp32 partials per segment of a key
block's pairs; these sums add them per (key block, output head) in a fixed order, so the
gradients are deterministic without atomics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from .configs import REDUCE_KEYS
from .launch import strides

if TYPE_CHECKING:
    from .problem import SparseAttentionProblem


@triton.jit
def _reduce_segments_kernel(
    PART, OUT, PART_B, OUT_B, BUCKET_SEGMENTS_END, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
    stride_t, stride_h, stride_b_t, stride_b_h, scale, scale_b, HI: tl.constexpr,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, KEYS: tl.constexpr,
):
    """KEYS keys of one (key block, output head) of dK, dV or d index_k: ``scale`` x the sum, in
    order, of the partials of the segments of its GROUP index heads (contiguous buckets). The
    programs past the first BLOCK // KEYS along axis 2 do the same for PART_B into OUT_B (same
    shape) with ``scale_b``: dK and dV in one launch."""
    global_block = tl.program_id(0).to(tl.int64)
    out_head = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    if chunk >= BLOCK // KEYS:
        PART, OUT, scale, chunk = PART_B, OUT_B, scale_b, chunk - BLOCK // KEYS
        stride_t, stride_h = stride_b_t, stride_b_h
    sequence = tl.load(BLOCK_SEQUENCE + global_block).to(tl.int64)
    if sequence < 0:
        return
    block = tl.load(BLOCK_LOCAL + global_block).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    first_bucket = global_block * HI + out_head * GROUP
    first_segment = tl.load(BUCKET_SEGMENTS_END + first_bucket - 1, mask=first_bucket > 0,
                            other=0).to(tl.int64)
    end_segment = tl.load(BUCKET_SEGMENTS_END + first_bucket + GROUP - 1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    keys = chunk * KEYS + tl.arange(0, KEYS)
    acc = tl.zeros((KEYS, HEAD_DIM), tl.float32)
    for segment in range(first_segment, end_segment):
        acc += tl.load(PART + (segment * BLOCK + keys)[:, None] * HEAD_DIM + dims[None, :])
    key_pos = block * BLOCK + keys.to(tl.int64)
    tl.store(OUT + (seq_start + key_pos)[:, None] * stride_t + out_head * stride_h
             + dims[None, :], (acc * scale).to(OUT.dtype.element_ty),
             mask=(key_pos < seq_len)[:, None])


def reduce_segments(part, out, scale, group, p: SparseAttentionProblem, part_b=None,
                    out_b=None, scale_b=1.0):
    """Sums the per-segment partials of every (key block, output head) into ``out`` (and, in
    the same launch, ``part_b``'s into ``out_b``, a tensor like ``out``)."""
    blocks = p.block_work
    # A program per REDUCE_KEYS keys of a (key block, head): a program per whole block leaves
    # most SMs idle at small sizes.
    keys = min(REDUCE_KEYS, p.block_size)
    paired = part_b is not None
    part_b, out_b = (part_b, out_b) if paired else (part, out)
    _reduce_segments_kernel[(blocks.num_global_blocks, out.shape[1],
                             (2 if paired else 1) * (p.block_size // keys))](
        part, out, part_b, out_b, blocks.bucket_segments_end, blocks.block_sequence,
        blocks.block_local, p.cu_seqlens, *strides(out, out_b), scale, scale_b,
        HI=p.num_index_heads, GROUP=group, BLOCK=p.block_size, HEAD_DIM=out.shape[2],
        KEYS=keys, num_warps=4)
    return (out, out_b) if paired else out
