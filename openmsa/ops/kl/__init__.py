"""The KL that trains the index branch (SPEC sections 3.7 and 4), from the forward's final
log-sum-exps: the dispatch between the Triton kernels (``kl.kernels``) and the Hopper one
(``kl.sm90``), and the choice of passes.

By default one key-outer pass over the dK/dV segments gives the gradients of index_q and index_k
by atomic adds, and the value; ``deterministic`` takes d index_q and the value from the
query-side walk instead (each (token, index head) written once) and d index_k from the
key-outer pass's ordered partials. The value alone (no gradient wanted) is the one-pass kernel
too, its gradients dropped: its cost follows the kept pairs, where the query-side walk pays for
the union of each query tile's blocks (several times the pairs on incoherent selections).
"""

from __future__ import annotations

import torch

from ..configs import KL_CONFIG, KL_TEACHER_CONFIG, KL_TEACHER_PAIRS
from ..problem import LOG2_E, SparseAttentionProblem
from ..segments import reduce_segments
from . import sm90
from .kernels import kl_query_side, scaled_kl_gradients, triton_key_walk

__all__ = ["index_branch_kl", "kl_from_teacher", "kl_key_walk", "kl_query_side",
           "new_teacher", "scaled_kl_gradients", "teacher_dtype"]


def kl_key_walk(q, k, index_q, index_k, lse, lse_index, p: SparseAttentionProblem,
                query_side: bool, with_value: bool, pairs=None,
                num_warps=KL_CONFIG["num_warps"], num_stages=KL_CONFIG["num_stages"],
                use_hopper: bool | None = None):
    """The key-outer KL kernel over the key-block -> queries list (on a Hopper GPU the Gluon
    kernel where it supports the inputs; else, with ``use_hopper=False`` or with ``pairs`` and
    the launch options, which tune it, the Triton kernel).
    Returns the unscaled KL gradient of index_k (fp32, index_k's shape; per-segment partials
    summed in order, or with ``query_side`` atomic adds) and, with ``query_side``, the KL's
    terms summed per program (fp32 [segments]: their sum over Nq * Hi is the KL; None unless
    ``with_value``) and the unscaled gradient of index_q (fp32 [T, Hi, Di], summed by atomic
    adds). The gradients are ``kl_grad * p.kl_gradient_scale()`` times the unscaled ones."""
    segments = p.block_work.segments.shape[0]
    if query_side:  # both gradients by atomic adds
        d_index_q = torch.zeros(p.total, p.num_index_heads, p.index_dim, dtype=torch.float32,
                                device=q.device)
        d_index_k = torch.zeros(index_k.shape, dtype=torch.float32, device=q.device)
    else:  # d index_k's partials per segment, summed in order below
        d_index_k = torch.empty(segments * p.block_size, p.index_dim, dtype=torch.float32,
                                device=q.device)
        d_index_q = d_index_k  # a placeholder
    value_parts = (torch.empty(segments, dtype=torch.float32, device=q.device)
                   if query_side and with_value else d_index_k)  # (else a placeholder)
    if (use_hopper is not False and pairs is None
            and sm90.supported_kl(q, k, index_q, index_k, p)):
        sm90.kl_key_walk_parts(q, k, index_q, index_k, lse, lse_index, p, d_index_k,
                               value_parts, d_index_q, query_side, with_value,
                               p.scale * LOG2_E, p.tuning.kl_pairs)
    else:
        triton_key_walk(q, k, index_q, index_k, lse, lse_index, p, d_index_k, value_parts,
                        d_index_q, query_side, with_value, pairs or p.tuning.kl_pairs,
                        num_warps=num_warps, num_stages=num_stages)
    if not query_side:
        return reduce_segments(d_index_k, torch.empty(index_k.shape, dtype=torch.float32,
                                                      device=q.device),
                               1.0, p.index_group, p), None, None
    return d_index_k, (value_parts if with_value else None), d_index_q


def index_branch_kl(q, k, index_q, index_k, lse, lse_index, p: SparseAttentionProblem,
                    with_value: bool, with_grad: bool, deterministic: bool):
    """The KL from the final log-sum-exps: (its terms summed in parts, per (token, index
    head) or per key-outer program, whose sum over Nq * Hi is the KL (``p.kl_mean``), or None
    unless ``with_value``; the unscaled gradients of index_q and index_k or None unless
    ``with_grad``).

    The gradients come from one key-outer pass (``kl_key_walk``) that sums them by atomic adds;
    ``deterministic`` instead takes d index_q and the value from the query-side walk, a second
    pass over the same pairs that writes each (token, index head) once, and d index_k from the
    key-outer pass's ordered partials. The value alone is the one-pass kernel's, its gradients
    dropped."""
    if not with_grad:
        # The key-outer kernel's value is summed per program in a fixed order: deterministic
        # whatever its atomic-add gradients, which are dropped here.
        _, value_parts, _ = kl_key_walk(q, k, index_q, index_k, lse, lse_index, p,
                                        query_side=True, with_value=True)
        return value_parts, None, None
    if deterministic:
        value_parts, d_index_q = kl_query_side(q, k, index_q, index_k, lse, lse_index, p,
                                               with_value=with_value, with_grad=True)
        d_index_k, _, _ = kl_key_walk(q, k, index_q, index_k, lse, lse_index, p,
                                      query_side=False, with_value=False)
        return value_parts, d_index_q, d_index_k
    d_index_k, value_parts, d_index_q = kl_key_walk(q, k, index_q, index_k, lse, lse_index,
                                                    p, query_side=True, with_value=with_value)
    return value_parts, d_index_q, d_index_k


def teacher_dtype(dtype: torch.dtype) -> torch.dtype:
    """The stored teachers' dtype for inputs of ``dtype``: fp16 for 16-bit inputs (11
    significant bits; the teacher lies in [0, 1]), fp32 for fp32 ones."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def new_teacher(q, p: SparseAttentionProblem) -> torch.Tensor:
    """The buffer the dK/dV pass stores each pair's KL teacher into (``Tuning.kl_teacher =
    "from_dkdv"``): [pairs of the key-block list, block], ``teacher_dtype``."""
    return torch.empty(p.block_work.pair_token.shape[0], p.block_size,
                       dtype=teacher_dtype(q.dtype), device=q.device)


def kl_from_teacher(q, k, index_q, index_k, lse, lse_index, teacher,
                    p: SparseAttentionProblem):
    """The unscaled KL gradients of index_q and index_k from the teacher the dK/dV pass stored
    (``new_teacher``): the key-outer Triton kernel with its student alone (no GQ products of
    main heads), both gradients by atomic adds, as ``index_branch_kl``'s default pass."""
    d_index_q = torch.zeros(p.total, p.num_index_heads, p.index_dim, dtype=torch.float32,
                            device=q.device)
    d_index_k = torch.zeros(index_k.shape, dtype=torch.float32, device=q.device)
    triton_key_walk(q, k, index_q, index_k, lse, lse_index, p, d_index_k, d_index_k,
                    d_index_q, query_side=True, with_value=False, pairs=KL_TEACHER_PAIRS,
                    teacher=teacher, **KL_TEACHER_CONFIG)
    return d_index_q, d_index_k
