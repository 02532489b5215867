"""The sparse main attention over the kept blocks (SPEC section 3, steps 5-6), forward and
backward: the dispatch between the Triton kernels (``forward``, ``backward``) and the Hopper
(Gluon) ones (``sm90_forward``, ``sm90_backward``), made here once per phase.

Each token brings only ``GQ = H / Hi`` query rows, too few for the tensor cores, so rows are
stacked from several tokens: forward and dQ are query-outer (a program per query tile of
``TOK`` tokens x ``GQ`` heads walks the tile's distinct kept blocks), dK and dV key-outer (a
program per segment of the pairs that kept one key block). Where ``Tuning``'s
``main_walk_limit_per_slot`` is set, the tiles whose union holds more blocks than that limit
(selections whose neighbours keep different blocks) take forward and dQ key-outer as well
(``key_outer``): the walk leaves their rows, which the key-outer pass writes. ``use_hopper=False``
forces the Triton kernels (benchmarks compare the two).
"""

from __future__ import annotations

import functools

import torch

from .. import sm90
from ..problem import LOG2_E, SparseAttentionProblem
from . import sm90_backward, sm90_forward
from .backward import (attention_delta, reduce_dkdv_parts, triton_backward_atomic_dq,
                       triton_dkdv_parts, triton_dq)
from .forward import index_log_sum_exp, index_log_sum_exp_key_outer, triton_forward
from .key_outer import (dkdv_with_hard_atomic_dq, hard_atomic_bytes, key_outer_dq,
                        key_outer_forward, walk_limit)

__all__ = ["attention_backward", "attention_delta", "attention_dkdv", "attention_dq",
           "index_log_sum_exp", "index_log_sum_exp_key_outer", "sparse_attention_fwd"]


def sparse_attention_fwd(q, k, v, index_q, index_k, p: SparseAttentionProblem,
                         index_max=None, num_warps=None, num_stages=None,
                         use_hopper: bool | None = None):
    """q [T, H, D], k, v [T, Hkv, D] (index_q [T, Hi, Di], index_k [T, Hik, Di] or None).
    Returns out [T, H, D] (q's dtype), lse2 [T, H] and the index log-sum-exp [T, Hi] (natural
    log over the kept tokens; None without the index branch), both fp32. ``index_max``: fp32
    [T, Hi], each row's largest index score over its kept tokens when known (selection's
    largest block score, when selection keeps the best block), or None.
    The Gluon kernel has no index branch: with one, the index log-sum-exp runs beside it on
    the Triton kernel's index part alone (with a running maximum when no row maxima are given:
    fp8 selection, given ids); with ``Tuning.index_lse_split`` (off) and row maxima, split
    between that walk and a key-outer pass by each tile's union.
    Warmup on these kernels (every causal block) without row maxima keeps the fused Triton
    forward, its one walk serving both branches (the split walk there is not yet measured).
    ``num_warps``, ``num_stages``: the Triton launch's. The rows of tiles past
    ``key_outer.walk_limit(p)`` come from the key-outer forward (either kernel's walk leaves
    them; the Triton one still walks their index branch)."""
    given = p.with_index and index_max is not None
    split = given or not p.with_index or not p.all_causal
    limit = walk_limit(p)
    if use_hopper is not False and split and sm90.supported(q, k, v, p):
        out, lse = sm90_forward.sparse_attention_fwd(q, k, v, p, p.scale * LOG2_E, limit)
        if limit:
            key_outer_forward(q, k, v, p, limit, out, lse, use_hopper)
        if not p.with_index:
            return out, lse, None
        if p.tuning.index_lse_split and index_max is not None:
            return out, lse, index_log_sum_exp_key_outer(index_q, index_k, index_max, p)
        return out, lse, index_log_sum_exp(index_q, index_k, index_max, p)
    out, lse, lse_index = triton_forward(q, k, v, index_q, index_k, p, index_max, num_warps,
                                         num_stages, limit)
    if limit:
        key_outer_forward(q, k, v, p, limit, out, lse, use_hopper)
    return out, lse, lse_index


def _hopper_dq(q, k, v, dout, p: SparseAttentionProblem, use_hopper: bool | None) -> bool:
    """Whether dq runs on the Gluon kernel."""
    return use_hopper is not False and sm90.supported(q, k, v, p) and dout.stride(2) == 1


def _walk_dq(q, k, v, dout, lse, delta, p: SparseAttentionProblem, limit: int,
             use_hopper: bool | None, out=None, **launch_options):
    """dq of the rows that walk (all of them at ``limit`` 0): the Gluon kernel where it runs
    (with ``out``, it also writes ``delta``'s rows, those it leaves too), else the Triton one."""
    if _hopper_dq(q, k, v, dout, p, use_hopper):
        return sm90_backward.attention_dq(q, k, v, dout, lse, delta, p, p.scale * LOG2_E,
                                          out=out, walk_limit=limit)
    return triton_dq(q, k, v, dout, lse, delta, p, walk_limit=limit, **launch_options)


def attention_dq(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
                 use_hopper: bool | None = None, **launch_options):
    """dq, query-outer: on a Hopper GPU the Gluon kernel where it supports the inputs, else (or
    with ``use_hopper=False``) the Triton kernel (``launch_options``: its num_warps,
    num_stages); the rows of tiles past ``key_outer.walk_limit(p)`` key-outer."""
    limit = walk_limit(p)
    dq = _walk_dq(q, k, v, dout, lse, delta, p, limit, use_hopper, **launch_options)
    if limit:
        key_outer_dq(q, k, v, dout, lse, delta, p, limit, dq, use_hopper)
    return dq


def attention_backward(q, k, v, out, dout, lse, p: SparseAttentionProblem,
                       use_hopper: bool | None = None, deterministic: bool = False,
                       teacher=None):
    """dq, dk, dv of the main attention: delta, the query-outer dQ, the key-outer dK/dV. The
    Gluon dQ computes the deltas itself (one pass over out and dout less), those of the rows
    it leaves to the key-outer dQ too. With ``Tuning.dq_pass = "dkdv_atomic"`` every row's
    dq comes from the dK/dV pass, added atomically (``backward.triton_backward_atomic_dq``),
    unless ``deterministic``. With ``"hard_atomic"`` the rows the walk leaves (tiles past
    ``key_outer.walk_limit(p)``) get theirs that way (``key_outer.dkdv_with_hard_atomic_dq``)
    instead of from the key-outer dQ, unless ``deterministic`` or the fp32 sum would take more
    than ``Tuning.hard_atomic_max_bytes``. ``teacher``: a [pairs, block] tensor the dK/dV pass
    stores each pair's KL teacher into (on the Triton kernels: ``Tuning.kl_teacher =
    "from_dkdv"``)."""
    dout = dout.contiguous()
    if p.tuning.dq_pass == "dkdv_atomic" and not deterministic:
        return triton_backward_atomic_dq(q, k, v, out, dout, lse, p, teacher)
    limit = walk_limit(p)
    if _hopper_dq(q, k, v, dout, p, use_hopper) and out.stride(2) == 1:
        delta = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
        dq = _walk_dq(q, k, v, dout, lse, delta, p, limit, use_hopper, out=out)
    else:
        delta = attention_delta(out, dout, p)
        dq = _walk_dq(q, k, v, dout, lse, delta, p, limit, use_hopper)
    if limit and _hard_rows_atomic(p, deterministic):
        parts = functools.partial(_dkdv_parts, q, k, v, dout, lse, delta, p, use_hopper,
                                  teacher)
        atomic_parts = functools.partial(triton_dkdv_parts, q, k, v, dout, lse, delta, p,
                                         teacher=teacher, hard_segments_only=True)
        return dkdv_with_hard_atomic_dq(q, k, v, dout, lse, delta, p, limit, dq, parts,
                                        atomic_parts)
    if limit:  # after the deltas of its rows, which the Gluon dQ wrote
        key_outer_dq(q, k, v, dout, lse, delta, p, limit, dq, use_hopper)
    return (dq,) + attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=use_hopper,
                                  teacher=teacher)


def _hard_rows_atomic(p: SparseAttentionProblem, deterministic: bool) -> bool:
    """Whether the rows the dQ walk leaves get their dq from the dK/dV pass's atomic adds
    (``Tuning.dq_pass = "hard_atomic"``) rather than from the key-outer dQ."""
    return (p.tuning.dq_pass == "hard_atomic" and not deterministic
            and hard_atomic_bytes(p) <= p.tuning.hard_atomic_max_bytes)


def _dkdv_parts(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
                use_hopper: bool | None, teacher=None, skip=None, parts=None, **launch_options):
    """The fp32 dK (unscaled) and dV partials per segment of the key-block list: from the
    Gluon kernel on a Hopper GPU where it supports the inputs (unless ``use_hopper=False`` or a
    ``teacher`` to store, which the Triton kernel does), else from the Triton kernel
    (``launch_options``: its num_warps, num_stages). ``skip`` (int32 per segment): the
    flagged segments are left (another launch writes them); ``parts``: the partials to write
    into (new ones by default)."""
    if (use_hopper is not False and teacher is None
            and sm90_backward.supported_key_outer(q, k, v, dout, p)):
        return sm90_backward.attention_dkdv_parts(q, k, v, dout, lse, delta, p,
                                                  p.scale * LOG2_E, skip=skip, parts=parts)
    return triton_dkdv_parts(q, k, v, dout, lse, delta, p, teacher=teacher, segment_hard=skip,
                             parts=parts, **launch_options)


def attention_dkdv(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
                   use_hopper: bool | None = None, teacher=None, **launch_options):
    """dk, dv, key-outer: fp32 partials per segment of pairs (``_dkdv_parts``: Gluon or
    Triton), then an in-order sum per key block."""
    dk_part, dv_part = _dkdv_parts(q, k, v, dout, lse, delta, p, use_hopper, teacher,
                                   **launch_options)
    return reduce_dkdv_parts(dk_part, dv_part, k, v, p)
