"""What the Hopper (sm_90) kernels of every stage share: Gluon layouts, a query tile's rows and
walk list, member masks, TMA rings of key blocks, a key-outer segment, and the host's checks of
which inputs they take.

The Hopper kernels (``attention.sm90_forward``, ``attention.sm90_backward``, ``kl.sm90``) run the
programs of the Triton kernels on the same work lists, in Gluon, Triton's lower-level language,
with what Triton cannot express:

- K and V blocks arrive by TMA into rings of shared memory (query-outer), or the gathered q, dO
  and index_q rows by ``cp.async`` (key-outer), the next ones while these are computed;
- the tensor-core products are issued asynchronously and waited for explicitly, so that
  exponentials run while the tensor cores compute another product (FlashAttention-3's
  intra-warpgroup overlap);
- warp specialization (forward, dQ, dK/dV): loader warps bring the key blocks (one each for K
  and V) or one warp gathers the query rows while each of two warpgroups computes half of the
  rows (in the forward and dQ half of a tile's tokens, passing over the blocks none of them
  kept), synchronized by mbarriers.

The forward and dQ are bitwise equal to the Triton kernels (same products, same order); dK/dV
and the KL sum the same terms in other groupings, equal up to fp32 rounding. The stages'
dispatches (``attention/__init__.py``, ``kl/__init__.py``) choose them where ``supported``,
``supported_key_outer`` and ``supported_kl`` say so; the CPU interpreter and the index branch's
log-sum-exp always run the Triton kernels.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .configs import KEY_STEP_ROWS


NUM_WARPS = 8  # two warpgroups: the MMA rows (128) split 64 / 64


ROWS = 128


HEAD_DIMS = (64, 128)


BLOCK_SIZES = (64, 128)


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    """The wgmma accumulator layout of [128, n] products: the warps stacked along the rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.constexpr_function
def _io_layout(head_dim, num_warps):
    """Rows of 16-bit [*, head_dim] tiles in 16-byte pieces, for loads and stores."""
    return gl.BlockedLayout([1, 8], [32 * 8 // head_dim, head_dim // 8], [num_warps, 1], [1, 0])


@gluon.jit
def _issue_block_load(desc, barrier, smem, row, col, pred):
    """TMA of one key block's [BLOCK, D] rows into ``smem``, completing on ``barrier``."""
    mbarrier.expect(barrier, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], barrier, smem, pred=pred)


@gluon.jit
def _block_row(blocks, u, walk_length, seq_start, BLOCK: gl.constexpr):
    """Packed row of the first key of walk entry ``u`` (clamped into the walk, so that a
    predicated-off load still has a valid address)."""
    block = gl.load(blocks + gl.minimum(u, walk_length - 1))
    return (seq_start + block * BLOCK).to(gl.int32)


@gluon.jit
def _row_head_token(rows, TOK: gl.constexpr):
    """Head and token of a 128-row query tile's rows: each 64-row half (one consumer
    warpgroup's) holds half of the tile's tokens, all heads, head-major, so that a warpgroup
    can pass over a walk entry none of its tokens kept (``_half_members``). A tile of one token
    splits its heads instead."""
    if TOK >= 2:
        HALF_TOKENS: gl.constexpr = TOK // 2
        within = rows % 64
        return within // HALF_TOKENS, (rows // 64) * HALF_TOKENS + within % HALF_TOKENS
    else:
        return rows, rows * 0


@gluon.jit
def _half_members(HALF: gl.constexpr, TOK: gl.constexpr):
    """The members-mask bits of the tokens in rows [64 HALF, 64 HALF + 64) of a query tile."""
    if TOK >= 2:
        HALF_TOKENS: gl.constexpr = TOK // 2
        return ((1 << HALF_TOKENS) - 1) << (HALF * HALF_TOKENS)
    else:
        return -1


@gluon.jit
def _tile_rows(index_head, first_position, first_query, end_query, query_base,
               GQ: gl.constexpr, TOK: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
               layout: gl.constexpr, FIRST_ROW: gl.constexpr = 0):
    """Per row of a [ROWS, HEAD_DIM] tile in ``layout``: whether it is a query, its token's
    row in the query tensors, its head; and the column indices. Computed where needed (before
    the walk, and again after it) rather than held in registers across it. The tile's rows
    [FIRST_ROW, FIRST_ROW + ROWS), laid out by ``_row_head_token``."""
    rows = FIRST_ROW + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    head, tok = _row_head_token(rows, TOK)
    valid = (head < GQ) & (tok >= first_query) & (tok < end_query)
    token = (query_base + first_position + tok).to(gl.int64)
    return valid, token, index_head * GQ + head, dims


@gluon.jit
def _tile_of(CU_SEQLENS, sequence, tile, query_start, query_end, TOK: gl.constexpr):
    """A query tile's sequence start and length, first position, queries (its tokens
    [first_query, end_query), see tiles._query_tile), the members mask of a block all its
    queries kept, and the query row of the sequence's position 0."""
    seq_start = gl.load(CU_SEQLENS + sequence)
    seq_len = gl.load(CU_SEQLENS + sequence + 1) - seq_start
    first_position = tile * TOK
    first_query = gl.maximum(query_start - seq_start - first_position, 0)
    end_query = gl.minimum(gl.minimum(query_end - seq_start, seq_len) - first_position, TOK)
    one = first_query.to(gl.int64) * 0 + 1
    all_members = (gl.where(end_query >= 64, -1, (one << end_query.to(gl.int64)) - 1)
                   - ((one << first_query.to(gl.int64)) - 1))
    return (seq_start, seq_len, first_position, first_query, end_query, all_members,
            seq_start - query_start)


@gluon.jit
def _mma_rows(first_position, first_query, end_query, GQ: gl.constexpr, TOK: gl.constexpr,
              ROWS: gl.constexpr, layout: gl.constexpr, FIRST_ROW: gl.constexpr = 0):
    """Per MMA row (in ``layout``, a row slice of the products; the tile's rows [FIRST_ROW,
    FIRST_ROW + ROWS), laid out by ``_row_head_token``): its head, its token's bit in a members
    mask, whether it is a query, its position."""
    head, tok = _row_head_token(FIRST_ROW + gl.arange(0, ROWS, layout=layout), TOK)
    row_valid = (head < GQ) & (tok >= first_query) & (tok < end_query)
    return head, tok.to(gl.int64), row_valid, first_position + tok


@gluon.jit
def _walk_of(UNION, UNION_MEMBERS, UNION_COUNT, entry, index_head, HI: gl.constexpr,
             UNION_SLOTS: gl.constexpr):
    """The tile's walk list (tiles._walk_list): blocks, token masks, length."""
    walk = (entry * HI + index_head) * UNION_SLOTS
    return (UNION + walk, UNION_MEMBERS + walk,
            gl.load(UNION_COUNT + entry * HI + index_head))


@gluon.jit
def _row_member(members, row_bit, row_valid):
    """Per row, whether its token kept the block whose token mask is ``members``. Before the
    tile the forward masks a block by a select per row instead of a mask per element (a bias of
    -inf added to the scores would be cheaper still, but leaves NaN scores NaN). dQ keeps one
    branch, ``_visible``'s comparison per element: a second branch made ptxas spill 56 bytes at
    16 heads per index head."""
    return (((members >> row_bit) & 1) != 0) & row_valid


@gluon.jit
def _visible(block, members, row_bit, row_valid, row_position, BLOCK: gl.constexpr,
             layout: gl.constexpr):
    """[ROWS, BLOCK]: whether a row sees a key of ``block``: its token kept the block and the
    key is not after the query (so it is in the sequence, as the query is). One comparison per
    element, with the row's last key: -1 where its token did not keep the block."""
    key_pos = block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
    last_key = gl.where(_row_member(members, row_bit, row_valid), row_position, -1)
    return key_pos[None, :] <= last_key[:, None]


@gluon.jit
def _ring_loads(desc, smem, full, empty, blocks, walk_length, seq_start, kv_col,
                BLOCK: gl.constexpr):
    """A loader (one warp) of the warp-specialized forward and dQ: each walk entry's K (or V)
    block by TMA into its two-stage ring, each stage once both consumers handed it back. K and
    V have a loader each, so that a V stage a consumer still holds never delays the next K
    (nor, in dQ, a held K the next V)."""
    for u in range(0, walk_length):
        stage = u % 2
        row = _block_row(blocks, u, walk_length, seq_start, BLOCK)
        mbarrier.wait(empty.index(stage), ((u // 2) & 1) ^ 1)
        _issue_block_load(desc, full.index(stage), smem.index(stage), row, kv_col, True)


@gluon.jit
def _pass_over(k_full, k_empty, v_full, v_empty, stage, phase):
    """A consumer's turn at a walk entry none of its rows kept: the entry's K and V stages
    handed back as soon as they have landed (the loaders count on both consumers' arrivals)."""
    mbarrier.wait(k_full.index(stage), phase)
    mbarrier.arrive(k_empty.index(stage), count=1)
    mbarrier.wait(v_full.index(stage), phase)
    mbarrier.arrive(v_empty.index(stage), count=1)


@gluon.jit
def _block_rings(k_desc, v_desc, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr):
    """``_ring_loads``' two-stage K and V rings in shared memory and their barriers: full
    (the TMA landed) and empty (both consumer warpgroups handed the stage back)."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK, HEAD_DIM], v_desc.layout)
    k_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(2):
        mbarrier.init(k_full.index(stage), count=1)
        mbarrier.init(v_full.index(stage), count=1)
        mbarrier.init(k_empty.index(stage), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(stage), count=2)
    fence_async_shared()
    return k_smem, v_smem, k_full, k_empty, v_full, v_empty


@gluon.jit
def _step_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """A key-outer kernel's barriers (dK/dV, the key-outer forward and dQ): ``kv_ready`` (K and
    V of the block landed, ``_block_kv_loads``) and, per slot of the ring of gathered steps,
    ``full`` (every copy of the gather warp's 32 threads landed) and ``empty`` (``CONSUMERS``
    consumer warpgroups handed it back)."""
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(full.index(stage), count=32)  # one arrival per gathering thread
        mbarrier.init(empty.index(stage), count=CONSUMERS)
    fence_async_shared()
    return kv_ready, full, empty


@gluon.jit
def _block_kv_loads(k_desc, v_desc, k_smem, v_smem, kv_ready, seq_start, block, index_head,
                    KV_GROUP: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr):
    """K and V of key block ``block`` (its KV head's columns) by TMA, once, completing
    ``kv_ready``."""
    row = (seq_start + block * BLOCK).to(gl.int32)
    kv_col = (index_head // KV_GROUP) * HEAD_DIM
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, kv_col], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row, kv_col], kv_ready, v_smem)


@gluon.jit
def _segment_of(SEGMENTS, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
                query_start, segment, bucket, HI: gl.constexpr, SEGMENT_PAIRS: gl.constexpr):
    """A key-outer segment's pairs [first, last), index head, key block, its sequence's first
    row and the query row of the sequence's position 0 (as tiles._segment)."""
    first = gl.load(SEGMENTS + 2 * segment + 1)
    global_block = bucket // HI
    sequence = gl.load(BLOCK_SEQUENCE + global_block)
    seq_start = gl.load(CU_SEQLENS + sequence)
    last = gl.minimum(first + SEGMENT_PAIRS,
                      gl.load(BUCKET_START + bucket) + gl.load(BUCKET_COUNT + bucket))
    block = gl.load(BLOCK_LOCAL + global_block)
    return first, last, bucket % HI, block, seq_start, seq_start - query_start


@gluon.jit
def _diagonal_pairs(PAIR_TOKEN, first, last, query_base, block, BLOCK: gl.constexpr,
                    layout: gl.constexpr):
    """How many of the segment's pairs have their query inside the key block, the only ones
    that need the causal mask: its first pairs (at most one per token of the block, in token
    order)."""
    pairs = first + gl.arange(0, BLOCK, layout=layout)
    inside = (gl.load(PAIR_TOKEN + pairs, mask=pairs < last, other=1 << 30) - query_base
              < block * BLOCK + BLOCK - 1)
    return gl.sum(inside.to(gl.int32), axis=0)


@gluon.jit
def _step_tokens(PAIR_TOKEN, first_pair, last, GQ: gl.constexpr, TOK: gl.constexpr,
                 ROWS: gl.constexpr, layout: gl.constexpr):
    """Query row of each row of a key-outer step of TOK pairs x GQ heads (head-major: row =
    g * TOK + t; the KL's units are one head) in ``layout``, 2^30 for rows of missing pairs or
    padding heads."""
    rows = gl.arange(0, ROWS, layout=layout)
    pair = first_pair + rows % TOK
    return gl.load(PAIR_TOKEN + pair, mask=(pair < last) & (rows // TOK < GQ), other=1 << 30)


_enabled = True


@contextlib.contextmanager
def disabled():
    """Within it, every stage runs its Triton kernels, also on a Hopper GPU (benchmarks time
    both in one run)."""
    global _enabled
    _enabled = False
    try:
        yield
    finally:
        _enabled = True


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether ``[T, heads, D]`` can be read as 2D ``[T, heads * D]`` by TMA: contiguous heads
    and 16-byte aligned base and row stride."""
    size = t.element_size()
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0
            and (t.stride(0) * size) % 16 == 0)


def _rows_ready(t: torch.Tensor) -> bool:
    """Whether rows of ``[T, heads, D]`` can be gathered in 16-byte pieces: contiguous last
    dimension, 16-byte aligned base and strides."""
    size = t.element_size()
    return (t.stride(2) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
            and (t.stride(1) * size) % 16 == 0)


def _hopper_16bit(q, *others) -> bool:
    """Whether ``q`` is on a Hopper GPU (compute capability 9.x) in 16 bits, and ``others``
    in its dtype."""
    return (_enabled and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype in (torch.bfloat16, torch.float16)
            and all(t.dtype == q.dtype for t in others))


def supported(q, k, v, p) -> bool:
    """Whether the Gluon kernels run the main-branch forward and dQ of ``p`` (a
    ``SparseAttentionProblem``): a Hopper GPU, 16-bit inputs, head dim 64 or 128, blocks of
    64 or 128 keys, 128-row query tiles, keys and values TMA can read."""
    return (_hopper_16bit(q, k, v) and q.stride(2) == 1 and p.head_dim in HEAD_DIMS
            and p.block_size in BLOCK_SIZES and p.query_rows == ROWS
            and _tma_ready(k) and _tma_ready(v))


def key_step_tokens(heads_per_token: int, rows: int = KEY_STEP_ROWS) -> int | None:
    """Pairs per key-outer step of ``rows`` rows of their padded heads (dK/dV's
    KEY_STEP_ROWS by default), or None when one pair's heads exceed a step."""
    padded = 1 << (heads_per_token - 1).bit_length()
    return rows // padded if padded <= rows else None


@functools.lru_cache(maxsize=None)
def _block_layout(block_size: int, dim: int, bf16: bool):
    """The shared-memory layout of a ``[block_size, dim]`` box (computed once: every launch of
    the Hopper kernels builds descriptors, on the host's critical path at short contexts)."""
    element = gl.bfloat16 if bf16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_size, dim], element)


def _block_descriptor(t: torch.Tensor, block_size: int) -> TensorDescriptor:
    """``[T, heads, D]`` as 2D ``[T, heads * D]`` in ``[block_size, D]`` boxes: one key block
    of one head per TMA."""
    total, heads, dim = t.shape
    return TensorDescriptor(t, [total, heads * dim], [t.stride(0), 1], [block_size, dim],
                            _block_layout(block_size, dim, t.dtype == torch.bfloat16))


def _maxnreg(warpgroups: int, workers: tuple) -> int:
    """A warp-specialized kernel's register limit per thread: its ``warpgroups`` share the
    register file, and the first one gets what the worker partitions (``workers``, registers
    per thread of each) leave of the limit times the warpgroups (at most 240)."""
    return (sum(workers) + 240) // warpgroups // 8 * 8
