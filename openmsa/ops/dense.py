"""Warmup's dense causal main attention through PyTorch's cuDNN attention (H100/H200).

In warmup every causal block is kept, so the main attention is plain dense causal GQA attention,
for which cuDNN is about 1.7x faster than the sparse walk over every block. The KL still needs
the main branch's per-head log-sum-exp (and the index branch's, over every causal key), which
the public ``scaled_dot_product_attention`` does not return, so this module calls the ATen
operators behind it, ``_scaled_dot_product_cudnn_attention`` and its backward, which do (with
native GQA).

Used only where they apply (``use_cudnn_dense``): CUDA, 16-bit inputs, batch rows of equal length
(not packed ``cu_seqlens``, whose per-sequence causality they do not take), and not
``deterministic=True`` (cuDNN's backward may accumulate in varying order). Everything else runs
the Triton kernels with every causal block kept.
"""

from __future__ import annotations

import torch

from .problem import LOG2_E
from .validate import MSAProblem


def use_cudnn_dense(q: torch.Tensor, problem: MSAProblem, deterministic: bool) -> bool:
    """Whether warmup's main attention runs on cuDNN for these inputs (see the module doc):
    whole batch rows (not packed, every token a query)."""
    whole_rows = (not problem.packed and problem.query_start == 0
                  and problem.seqlen == problem.num_keys)
    return (whole_rows and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and not deterministic and torch.backends.cudnn.is_available())


def _heads_major(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """Packed ``[B * S, heads, D]`` -> ``[B, heads, S, D]`` (a view)."""
    return tensor.view(batch, -1, *tensor.shape[1:]).transpose(1, 2)


def _token_major(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, heads, S, D]`` -> packed ``[B * S, heads, D]``."""
    return tensor.transpose(1, 2).reshape(-1, tensor.shape[1], tensor.shape[3])


def _token_major_rows(lse: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The operator's log-sum-exp ``[B, heads, S, 1]`` -> contiguous ``[B * S, heads]`` (the
    kernels index it as such; with B = 1 a reshape alone would return a strided view)."""
    return lse.view(batch, -1, seqlen).transpose(1, 2).reshape(batch * seqlen, -1).contiguous()


def dense_attention_forward(q, k, v, batch: int, softmax_scale: float):
    """q ``[B * S, H, D]``, k, v ``[B * S, Hkv, D]``. Returns out ``[B * S, H, D]`` and the
    main log-sum-exp in the kernels' convention (base 2 of the scaled scores) ``[B * S, H]``,
    fp32."""
    seqlen = q.shape[0] // batch
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads_major(q, batch), _heads_major(k, batch), _heads_major(v, batch), None,
        True, 0.0, True, False, scale=softmax_scale)  # no bias; lse; no dropout; causal
    return _token_major(out).contiguous(), _token_major_rows(lse * LOG2_E, batch, seqlen)


def dense_log_sum_exp(index_q, index_k, batch: int, index_scale: float) -> torch.Tensor:
    """The index branch's log-sum-exp over every causal key (warmup's kept tokens), natural log,
    fp32 ``[B * S, Hi]``: the same operator on the index heads (its output is not used)."""
    seqlen = index_q.shape[0] // batch
    if index_scale < 0:  # the operator's scale is positive: flip the queries instead
        index_q, index_scale = -index_q, -index_scale
    keys = _heads_major(index_k, batch)
    _, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads_major(index_q, batch), keys, keys, None, True, 0.0, True, False,
        scale=index_scale)
    return _token_major_rows(lse, batch, seqlen)


def dense_attention_backward(dout, q, k, v, out, lse2, batch: int, softmax_scale: float):
    """dq, dk, dv (packed layouts) of ``dense_attention_forward``'s attention."""
    seqlen = q.shape[0] // batch
    lse = (lse2 / LOG2_E).view(batch, seqlen, -1).transpose(1, 2).contiguous()[..., None]
    no_dropout_rng = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _heads_major(dout.contiguous(), batch), _heads_major(q, batch), _heads_major(k, batch),
        _heads_major(v, batch), _heads_major(out, batch), lse, no_dropout_rng, no_dropout_rng,
        None, None, None, seqlen, seqlen, 0.0, True, scale=softmax_scale)
    return _token_major(dq), _token_major(dk), _token_major(dv)
