"""Argument validation of ``msa_attention`` / ``naive_msa_attention`` (SPEC sections 2, 5, 6, 7).

Every bad-input case starts from a known-valid call (see
``test_valid_base_call_is_accepted``) and breaks exactly one thing. Each case checks the exception
type, that the message starts with the argument's name, and (where sensible) that it ends with the
received value. The reference forward is replaced by a tripwire while bad inputs are checked, so a
check that only fires after computation started fails the test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import openmsa
from openmsa.ops import msa as msa_module

F32 = torch.float32
ENTRY_POINTS = {"msa_attention": openmsa.msa_attention,
                "naive_msa_attention": openmsa.naive_msa_attention}
INPUTS = ("q", "k", "v", "index_q", "index_k")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def make_call(B=1, S=8, H=4, Hkv=2, Hi=2, Hik=1, D=64, Di=64, dtype=F32, seqlens=None,
              query_range=None, **kwargs):
    """A valid call: the five tensors plus keyword arguments (top_k=2, block_size=64).

    ``seqlens`` given -> packed 3-D ``[T, heads, dim]`` input with matching ``cu_seqlens``.
    ``query_range=(first, end)`` cuts q and index_q to those tokens (``query_start=first``).
    """
    gen = torch.Generator().manual_seed(0)
    lead = (sum(seqlens),) if seqlens is not None else (B, S)
    heads = dict(q=(H, D), k=(Hkv, D), v=(Hkv, D), index_q=(Hi, Di), index_k=(Hik, Di))
    call = {name: torch.randn(*lead, *hd, generator=gen, dtype=dtype)
            for name, hd in heads.items()}
    call.update(top_k=2, block_size=64)
    if seqlens is not None:
        offsets = [0]
        for n in seqlens:
            offsets.append(offsets[-1] + n)
        call["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32)
    if query_range is not None:
        first, end = query_range
        for name in ("q", "index_q"):
            call[name] = call[name][..., first:end, :, :]
        call["query_start"] = first
    call.update(kwargs)
    return call


def invoke(fn, call):
    call = dict(call)
    tensors = [call.pop(name) for name in INPUTS]
    return fn(*tensors, **call)


def retensor(name, **to):
    """Edit: convert input ``name`` (dtype=..., or device='meta')."""
    def edit(call):
        t = call[name]
        if to.get("device") == "meta":
            call[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        else:
            call[name] = t.to(**to)
    return edit


def reshape(name, shape):
    """Edit: replace input ``name`` by a random tensor of ``shape`` (same dtype)."""
    def edit(call):
        call[name] = torch.randn(*shape, dtype=call[name].dtype)
    return edit


def setitem(**items):
    def edit(call):
        call.update({k: (v() if callable(v) else v) for k, v in items.items()})
    return edit


def chain(*edits):
    def edit(call):
        for e in edits:
            e(call)
    return edit


def cu(*offsets, dtype=torch.int32):
    return lambda: torch.tensor(offsets, dtype=dtype)


@dataclass
class Bad:
    id: str
    exc: type
    match: str  # regex, searched in str(exception); anchored at the argument name
    base: dict = field(default_factory=dict)  # make_call(**base): must be a valid call
    edit: Callable | None = None  # breaks exactly one thing of the valid call

    def build(self):
        call = make_call(**self.base)
        if self.edit is not None:
            self.edit(call)
        return call


PACKED = dict(seqlens=(5, 11))  # T = 16, cu_seqlens = [0, 5, 16]
BLOCKS = dict(S=70)  # 2 key blocks of 64: queries 0-63 own block 0, queries 64-69 block 1


def block_ids(shape=(1, 2, 70, 2), dtype=torch.int32):
    """Valid-looking ids: every row holds its query's own block, then -1 slots."""
    def make():
        ids = torch.full(shape, -1, dtype=torch.int64)
        if len(shape) == 4 and shape[-1] > 0:
            own = torch.arange(shape[2]) // 64
            ids[..., 0] = own.view(1, 1, -1).expand(shape[:3])
        return ids.to(dtype)
    return make


# --------------------------------------------------------------------------------------------
# The bad-input cases (SPEC section 7)
# --------------------------------------------------------------------------------------------

BAD: list[Bad] = []

# Non-tensor inputs.
for _name in INPUTS:
    BAD.append(Bad(f"{_name}_is_a_list", TypeError,
                   rf"^{_name}: expected a torch\.Tensor, received list$",
                   edit=lambda c, n=_name: c.__setitem__(n, c[n].tolist())))
BAD.append(Bad("q_is_none", TypeError, r"^q: expected a torch\.Tensor, received NoneType$",
               edit=setitem(q=None)))

# Mismatched dtypes between the five tensors.
for _name in INPUTS[1:]:
    BAD.append(Bad(f"{_name}_dtype_differs_from_q", ValueError,
                   rf"^{_name}: expected dtype torch\.float32 \(the dtype of q\), "
                   rf"received torch\.float16$",
                   edit=retensor(_name, dtype=torch.float16)))
BAD.append(Bad("q_dtype_differs_from_the_rest", ValueError,
               r"^k: expected dtype torch\.bfloat16 \(the dtype of q\), received torch\.float32$",
               edit=retensor("q", dtype=torch.bfloat16)))
BAD.append(Bad("integer_inputs", ValueError, r"^q: expected dtype in .*received torch\.int32$",
               edit=chain(*(retensor(n, dtype=torch.int32) for n in INPUTS))))

# Mismatched devices (the 'meta' device stands in for a second device).
for _name in INPUTS[1:]:
    BAD.append(Bad(f"{_name}_on_another_device", ValueError,
                   rf"^{_name}: expected device cpu \(the device of q\), received meta$",
                   edit=retensor(_name, device="meta")))
BAD.append(Bad("q_on_another_device", ValueError,
               r"^k: expected device meta \(the device of q\), received cpu$",
               edit=retensor("q", device="meta")))

# Wrong ranks.
BAD.append(Bad("q_5d", ValueError, r"^q: expected a 4-D .*received shape \(1, 1, 8, 4, 64\)$",
               edit=lambda c: c.__setitem__("q", c["q"][None])))
BAD.append(Bad("q_3d_without_cu_seqlens", ValueError,
               r"^q: expected a 4-D .*received shape \(8, 4, 64\)$",
               edit=lambda c: c.__setitem__("q", c["q"][0])))
for _name in INPUTS[1:]:
    BAD.append(Bad(f"{_name}_3d_while_q_is_4d", ValueError,
                   rf"^{_name}: expected a 4-D .*received shape \(8, \d, 64\)$",
                   edit=lambda c, n=_name: c.__setitem__(n, c[n][0])))
BAD.append(Bad("k_4d_while_packed_q_is_3d", ValueError,
               r"^k: expected a 3-D .*received shape \(1, 16, 2, 64\)$", base=PACKED,
               edit=lambda c: c.__setitem__("k", c["k"][None])))

# Mismatched batch / sequence dimensions.
_SHAPES = dict(q=(4, 64), k=(2, 64), v=(2, 64), index_q=(2, 64), index_k=(1, 64))
for _name in INPUTS[1:]:
    BAD.append(Bad(f"{_name}_sequence_length_differs", ValueError,
                   rf"^{_name}: expected leading dimensions \(1, 8\) \(those of q\), "
                   rf"received \(1, 9\)$",
                   edit=reshape(_name, (1, 9, *_SHAPES[_name]))))
    BAD.append(Bad(f"{_name}_batch_differs", ValueError,
                   rf"^{_name}: expected leading dimensions \(1, 8\) \(those of q\), "
                   rf"received \(2, 8\)$",
                   edit=reshape(_name, (2, 8, *_SHAPES[_name]))))
BAD.append(Bad("packed_k_token_count_differs", ValueError,
               r"^k: expected leading dimensions \(16,\) .*received \(15,\)$", base=PACKED,
               edit=reshape("k", (15, 2, 64))))

# v shape != k shape; head dims of k / index_k.
BAD.append(Bad("v_heads_differ_from_k", ValueError,
               r"^v: expected shape \(1, 8, 2, 64\) \(the shape of k\), "
               r"received \(1, 8, 4, 64\)$", edit=reshape("v", (1, 8, 4, 64))))
BAD.append(Bad("v_head_dim_differs_from_k", ValueError,
               r"^v: expected shape \(1, 8, 2, 64\) .*received \(1, 8, 2, 128\)$",
               edit=reshape("v", (1, 8, 2, 128))))
BAD.append(Bad("k_head_dim_differs_from_q", ValueError,
               r"^k: expected head dim 64 \(the head dim of q\), received 128$",
               edit=chain(reshape("k", (1, 8, 2, 128)), reshape("v", (1, 8, 2, 128)))))
BAD.append(Bad("index_k_head_dim_differs_from_index_q", ValueError,
               r"^index_k: expected head dim 64 \(the head dim of index_q\), received 128$",
               edit=reshape("index_k", (1, 8, 1, 128))))

# Head counts that do not divide.
BAD += [
    Bad("H_not_divisible_by_Hkv", ValueError,
        r"^k: expected a number of heads dividing the 4 heads of q, received 3$",
        base=dict(H=4, Hkv=1, Hi=1), edit=chain(reshape("k", (1, 8, 3, 64)),
                                                 reshape("v", (1, 8, 3, 64)))),
    Bad("Hkv_larger_than_H", ValueError,
        r"^k: expected a number of heads dividing the 2 heads of q, received 4$",
        base=dict(H=2, Hkv=1, Hi=1), edit=chain(reshape("k", (1, 8, 4, 64)),
                                                 reshape("v", (1, 8, 4, 64)))),
    Bad("H_not_divisible_by_Hi", ValueError,
        r"^index_q: expected a number of heads dividing the 4 heads of q, received 3$",
        base=dict(H=4, Hkv=1, Hi=1), edit=reshape("index_q", (1, 8, 3, 64))),
    Bad("Hi_not_divisible_by_Hkv", ValueError,
        r"^index_q: expected a multiple of the 2 heads of k .*received 1$",
        base=dict(H=4, Hkv=2, Hi=2), edit=reshape("index_q", (1, 8, 1, 64))),
    Bad("Hi_not_divisible_by_Hik", ValueError,
        r"^index_k: expected a number of heads dividing the 4 heads of index_q, received 3$",
        base=dict(H=4, Hkv=2, Hi=4, Hik=1), edit=reshape("index_k", (1, 8, 3, 64))),
    Bad("Hik_larger_than_Hi", ValueError,
        r"^index_k: expected a number of heads dividing the 2 heads of index_q, received 4$",
        edit=reshape("index_k", (1, 8, 4, 64))),
    Bad("zero_kv_heads", ValueError, r"^k: expected at least one head, received 0$",
        edit=chain(reshape("k", (1, 8, 0, 64)), reshape("v", (1, 8, 0, 64)))),
    Bad("zero_index_key_heads", ValueError, r"^index_k: expected at least one head, received 0$",
        edit=reshape("index_k", (1, 8, 0, 64))),
]

# Unsupported head dims.
for _d in (32, 96):
    BAD.append(Bad(f"q_head_dim_{_d}", ValueError,
                   rf"^q: expected head dim in \(64, 128, 256\), received {_d}$",
                   edit=chain(*(reshape(n, (1, 8, _SHAPES[n][0], _d)) for n in ("q", "k", "v")))))
    BAD.append(Bad(f"index_q_head_dim_{_d}", ValueError,
                   rf"^index_q: expected head dim in \(64, 128, 256\), received {_d}$",
                   edit=chain(*(reshape(n, (1, 8, _SHAPES[n][0], _d))
                                for n in ("index_q", "index_k")))))

# block_size, top_k, num_local_blocks, num_sink_blocks.
BAD += [
    Bad("block_size_32", ValueError, r"^block_size: expected one of \(64, 128\), received 32$",
        edit=setitem(block_size=32)),
    Bad("block_size_256", ValueError, r"^block_size: expected one of \(64, 128\), received 256$",
        edit=setitem(block_size=256)),
    Bad("block_size_float", TypeError, r"^block_size: expected an int, received float$",
        edit=setitem(block_size=64.0)),
    Bad("block_size_none", TypeError, r"^block_size: expected an int, received NoneType$",
        edit=setitem(block_size=None)),
    Bad("top_k_0", ValueError, r"^top_k: expected an int in \[1, 64\], received 0$",
        edit=setitem(top_k=0)),
    Bad("top_k_negative", ValueError, r"^top_k: expected an int in \[1, 64\], received -1$",
        edit=setitem(top_k=-1)),
    Bad("top_k_65", ValueError, r"^top_k: expected an int in \[1, 64\], received 65$",
        edit=setitem(top_k=65)),
    Bad("top_k_float", TypeError, r"^top_k: expected an int, received float$",
        edit=setitem(top_k=2.0)),
    Bad("top_k_str", TypeError, r"^top_k: expected an int, received str$",
        edit=setitem(top_k="2")),
    Bad("top_k_bool", TypeError, r"^top_k: expected an int, received bool$",
        edit=setitem(top_k=True)),
    Bad("num_local_blocks_0", ValueError, r"^num_local_blocks: expected an int >= 1.*received 0$",
        edit=setitem(num_local_blocks=0)),
    Bad("num_local_blocks_float", TypeError, r"^num_local_blocks: expected an int, received float$",
        edit=setitem(num_local_blocks=1.0)),
    Bad("local_block_dilation_0", ValueError,
        r"^local_block_dilation: expected an int >= 1 \(1: contiguous local blocks\), received 0$",
        edit=setitem(local_block_dilation=0)),
    Bad("local_block_dilation_float", TypeError,
        r"^local_block_dilation: expected an int, received float$",
        edit=setitem(local_block_dilation=2.0)),
    Bad("local_block_dilation_bool", TypeError,
        r"^local_block_dilation: expected an int, received bool$",
        edit=setitem(local_block_dilation=True)),
    Bad("num_sink_blocks_negative", ValueError,
        r"^num_sink_blocks: expected an int >= 0, received -1$", edit=setitem(num_sink_blocks=-1)),
    Bad("num_sink_blocks_none", TypeError, r"^num_sink_blocks: expected an int, received NoneType$",
        edit=setitem(num_sink_blocks=None)),
    Bad("local_plus_sink_exceeds_top_k", ValueError,
        r"^num_local_blocks \+ num_sink_blocks: expected <= top_k=2, received 3$",
        edit=setitem(num_local_blocks=2, num_sink_blocks=1)),
    Bad("local_alone_exceeds_top_k", ValueError,
        r"^num_local_blocks \+ num_sink_blocks: expected <= top_k=2, received 3$",
        edit=setitem(num_local_blocks=3)),
]

# cu_seqlens / max_seqlen.
BAD += [
    Bad("cu_seqlens_int64", ValueError,
        r"^cu_seqlens: expected dtype torch\.int32, received torch\.int64$", base=PACKED,
        edit=setitem(cu_seqlens=cu(0, 5, 16, dtype=torch.int64))),
    Bad("cu_seqlens_float", ValueError,
        r"^cu_seqlens: expected dtype torch\.int32, received torch\.float32$", base=PACKED,
        edit=setitem(cu_seqlens=cu(0, 5, 16, dtype=torch.float32))),
    Bad("cu_seqlens_list", TypeError, r"^cu_seqlens: expected a torch\.Tensor, received list$",
        base=PACKED, edit=setitem(cu_seqlens=[0, 5, 16])),
    Bad("cu_seqlens_2d", ValueError, r"^cu_seqlens: expected a 1-D .*received shape \(1, 3\)$",
        base=PACKED, edit=setitem(cu_seqlens=lambda: torch.tensor([[0, 5, 16]], dtype=torch.int32))),
    Bad("cu_seqlens_single_entry", ValueError,
        r"^cu_seqlens: expected a 1-D .*received shape \(1,\)$", base=PACKED,
        edit=setitem(cu_seqlens=cu(16))),
    Bad("cu_seqlens_on_another_device", ValueError,
        r"^cu_seqlens: expected device cpu \(the device of q\), received meta$", base=PACKED,
        edit=setitem(cu_seqlens=lambda: torch.empty(3, dtype=torch.int32, device="meta"))),
    Bad("cu_seqlens_not_starting_at_0", ValueError,
        r"^cu_seqlens: expected first entry 0, received 1$", base=PACKED,
        edit=setitem(cu_seqlens=cu(1, 5, 16))),
    Bad("cu_seqlens_decreasing", ValueError,
        r"^cu_seqlens: expected non-decreasing offsets, received \[0, 10, 5, 16\]$", base=PACKED,
        edit=setitem(cu_seqlens=cu(0, 10, 5, 16))),
    Bad("cu_seqlens_ends_before_T", ValueError,
        r"^cu_seqlens: expected last entry equal to the packed token count T=16, received 15$",
        base=PACKED, edit=setitem(cu_seqlens=cu(0, 5, 15))),
    Bad("cu_seqlens_ends_after_T", ValueError,
        r"^cu_seqlens: expected last entry equal to the packed token count T=16, received 17$",
        base=PACKED, edit=setitem(cu_seqlens=cu(0, 5, 17))),
    Bad("cu_seqlens_with_4d_batch_2", ValueError,
        r"^q: expected batch dimension 1 .*cu_seqlens.*received shape \(2, 8, 4, 64\)$",
        base=dict(B=2, S=8), edit=setitem(cu_seqlens=cu(0, 8, 16))),
    Bad("max_seqlen_below_longest_sequence", ValueError,
        r"^max_seqlen: expected >= the longest sequence in cu_seqlens \(11\), received 10$",
        base=PACKED, edit=setitem(max_seqlen=10)),
    Bad("max_seqlen_0", ValueError, r"^max_seqlen: expected an int >= 1, received 0$",
        base=PACKED, edit=setitem(max_seqlen=0)),
    Bad("max_seqlen_float", TypeError, r"^max_seqlen: expected an int, received float$",
        base=PACKED, edit=setitem(max_seqlen=11.0)),
    Bad("max_seqlen_without_cu_seqlens", ValueError,
        r"^max_seqlen: expected None unless cu_seqlens is given, received 8$",
        edit=setitem(max_seqlen=8)),
]

# Scales.
for _arg in ("softmax_scale", "index_softmax_scale"):
    for _label, _value, _shown in (("inf", math.inf, "inf"), ("neg_inf", -math.inf, "-inf"),
                                   ("nan", math.nan, "nan")):
        BAD.append(Bad(f"{_arg}_{_label}", ValueError,
                       rf"^{_arg}: expected a finite number, received {_shown}$",
                       edit=setitem(**{_arg: _value})))
    BAD.append(Bad(f"{_arg}_str", TypeError,
                   rf"^{_arg}: expected a real number or None, received str$",
                   edit=setitem(**{_arg: "0.1"})))
    BAD.append(Bad(f"{_arg}_tensor", TypeError,
                   rf"^{_arg}: expected a real number or None, received Tensor$",
                   edit=setitem(**{_arg: lambda: torch.tensor(0.1)})))

# backend and flags.
BAD += [
    Bad("backend_cuda", ValueError,
        r"^backend: expected one of \('auto', 'triton', 'reference'\), received 'cuda'$",
        edit=setitem(backend="cuda")),
    Bad("backend_none", TypeError, r"^backend: expected a str, received NoneType$",
        edit=setitem(backend=None)),
    Bad("warmup_int", TypeError, r"^warmup: expected a bool, received int$",
        edit=setitem(warmup=1)),
    Bad("deterministic_str", TypeError, r"^deterministic: expected a bool, received str$",
        edit=setitem(deterministic="yes")),
    Bad("return_indices_none", TypeError, r"^return_indices: expected a bool, received NoneType$",
        edit=setitem(return_indices=None)),
    Bad("kl_value_str", TypeError, r"^kl_value: expected a bool, received str$",
        edit=setitem(kl_value="yes")),
    Bad("kl_value_int", TypeError, r"^kl_value: expected a bool, received int$",
        edit=setitem(kl_value=0)),
    Bad("return_indices_with_warmup", ValueError,
        r"^return_indices: expected False when warmup=True .*received True$",
        edit=setitem(return_indices=True, warmup=True)),
]

# block_indices ([B, Hi, S, k] = [1, 2, 70, k]; 2 blocks -> entries in [-1, 1]).
BAD += [
    Bad("block_indices_float", ValueError,
        r"^block_indices: expected dtype torch\.int32 or torch\.int64, received torch\.float32$",
        base=BLOCKS, edit=setitem(block_indices=block_ids(dtype=torch.float32))),
    Bad("block_indices_list", TypeError,
        r"^block_indices: expected a torch\.Tensor, received list$", base=BLOCKS,
        edit=setitem(block_indices=[[0]])),
    Bad("block_indices_wrong_sequence_length", ValueError,
        r"^block_indices: expected shape \[B, Hi, S, top_k\] = \(1, 2, 70, 'k'\), "
        r"received \(1, 2, 69, 2\)$", base=BLOCKS,
        edit=setitem(block_indices=block_ids(shape=(1, 2, 69, 2)))),
    Bad("block_indices_wrong_heads", ValueError,
        r"^block_indices: expected shape .*received \(1, 4, 70, 2\)$", base=BLOCKS,
        edit=setitem(block_indices=block_ids(shape=(1, 4, 70, 2)))),
    Bad("block_indices_3d", ValueError,
        r"^block_indices: expected shape .*received \(2, 70, 2\)$", base=BLOCKS,
        edit=setitem(block_indices=block_ids(shape=(2, 70, 2)))),
    Bad("block_indices_no_slots", ValueError,
        r"^block_indices: expected at least one slot .*received \(1, 2, 70, 0\)$", base=BLOCKS,
        edit=setitem(block_indices=block_ids(shape=(1, 2, 70, 0)))),
    Bad("block_indices_minus_2", ValueError,
        r"^block_indices: expected entries in \[-1, own block of the query\].*received an entry "
        r"outside that range$",
        base=BLOCKS, edit=setitem(block_indices=lambda: block_ids()().index_fill_(2, torch.tensor([5]), -2))),
    Bad("block_indices_equal_to_num_blocks", ValueError,
        r"^block_indices: expected entries in \[-1, own block of the query\].*received an entry "
        r"outside that range$",
        base=BLOCKS, edit=setitem(block_indices=lambda: block_ids()().index_fill_(2, torch.tensor([69]), 2))),
    Bad("block_indices_future_block", ValueError,
        r"^block_indices: expected entries in \[-1, own block of the query\]",
        base=BLOCKS, edit=setitem(block_indices=lambda: block_ids()().index_fill_(2, torch.tensor([3]), 1))),
    Bad("block_indices_without_own_block", ValueError,
        r"^block_indices: expected the query's own block in every row .*received a row without it$",
        base=BLOCKS, edit=setitem(block_indices=lambda: block_ids()().fill_(-1))),
    Bad("block_indices_repeated_block", ValueError,
        r"^block_indices: expected each block at most once in a row \(-1 may repeat\), "
        r"received a row holding a block twice$",
        base=BLOCKS, edit=setitem(block_indices=lambda: block_ids(shape=(1, 2, 70, 3))()
                                  .index_fill_(3, torch.tensor([1]), 0))),
    Bad("block_indices_on_another_device", ValueError,
        r"^block_indices: expected device cpu \(the device of q\), received meta$", base=BLOCKS,
        edit=setitem(block_indices=lambda: torch.empty(1, 2, 70, 2, dtype=torch.int32,
                                                       device="meta"))),
    Bad("block_indices_with_warmup", ValueError,
        r"^block_indices: expected None when warmup=True .*received a tensor$", base=BLOCKS,
        edit=setitem(block_indices=block_ids(), warmup=True)),
    Bad("packed_block_indices_wrong_layout", ValueError,
        r"^block_indices: expected shape \[Hi, T, top_k\] = \(2, 16, 'k'\), "
        r"received \(1, 2, 16, 2\)$", base=PACKED,
        edit=setitem(block_indices=block_ids(shape=(1, 2, 16, 2)))),
]

# Query ranges (q and index_q hold packed tokens [query_start, query_start + Tq)).
RANGE = dict(seqlens=(5, 11), query_range=(3, 12))  # queries 3..11 of the 16 packed tokens
RANGE_OF_ONE_SEQUENCE = dict(query_range=(2, 7))  # positions 2..6 of the 8 of a batch of one
BAD += [
    Bad("query_range_with_a_batch_of_two", ValueError,
        r"^query_start: expected a batch of one with a query range \(or packed input\), "
        r"received batches of 2 \(q\) and 2 \(k\)$",
        base=dict(B=2), edit=setitem(query_start=0)),
    Bad("query_range_k_batch_differs", ValueError,
        r"^query_start: expected a batch of one .*received batches of 1 \(q\) and 2 \(k\)$",
        base=RANGE_OF_ONE_SEQUENCE,
        edit=chain(*(reshape(n, (2, 8, *_SHAPES[n])) for n in ("k", "v", "index_k")))),
    Bad("query_range_of_one_sequence_past_the_keys", ValueError,
        r"^query_start: expected at most 3 \(the 5 query tokens of q must lie within the 8 "
        r"tokens of k\), received 4$", base=RANGE_OF_ONE_SEQUENCE,
        edit=setitem(query_start=4)),
    Bad("query_start_negative", ValueError, r"^query_start: expected an int >= 0, received -1$",
        base=RANGE, edit=setitem(query_start=-1)),
    Bad("query_start_float", TypeError, r"^query_start: expected an int, received float$",
        base=RANGE, edit=setitem(query_start=3.0)),
    Bad("query_range_past_the_keys", ValueError,
        r"^query_start: expected at most 7 \(the 9 query tokens of q must lie within the 16 "
        r"tokens of k\), received 8$", base=RANGE, edit=setitem(query_start=8)),
    Bad("query_range_index_q_length_differs", ValueError,
        r"^index_q: expected leading dimensions \(9,\) \(those of q\), received \(16,\)$",
        base=RANGE, edit=reshape("index_q", (16, 2, 64))),
    Bad("query_range_v_length_differs", ValueError,
        r"^v: expected leading dimensions \(16,\) \(those of k\), received \(15,\)$",
        base=RANGE, edit=reshape("v", (15, 2, 64))),
    Bad("query_range_cu_seqlens_counts_the_queries", ValueError,
        r"^cu_seqlens: expected last entry equal to the packed token count T=16, received 9$",
        base=RANGE, edit=setitem(cu_seqlens=cu(0, 4, 9))),
    Bad("kl_num_queries_below_the_queries", ValueError,
        r"^kl_num_queries: expected an int >= 9 \(the query tokens of q\), received 8$",
        base=RANGE, edit=setitem(kl_num_queries=8)),
    Bad("kl_num_queries_float", TypeError, r"^kl_num_queries: expected an int, received float$",
        base=RANGE, edit=setitem(kl_num_queries=16.0)),
    Bad("query_range_block_indices_without_own_block", ValueError,
        r"^block_indices: expected the query's own block in every row", base=RANGE,
        edit=setitem(block_indices=lambda: torch.full((2, 9, 1), -1, dtype=torch.int32))),
]

# Zero tokens.
BAD += [
    Bad("zero_tokens", ValueError,
        r"^q: expected at least one query token, received shape \(1, 0, 4, 64\)$",
        edit=chain(*(reshape(n, (1, 0, *_SHAPES[n])) for n in INPUTS))),
    Bad("zero_batch", ValueError,
        r"^q: expected at least one query token, received shape \(0, 8, 4, 64\)$",
        edit=chain(*(reshape(n, (0, 8, *_SHAPES[n])) for n in INPUTS))),
    Bad("packed_zero_tokens", ValueError,
        r"^q: expected at least one query token, received shape \(0, 4, 64\)$", base=PACKED,
        edit=chain(*(reshape(n, (0, *_SHAPES[n])) for n in INPUTS),
                   setitem(cu_seqlens=cu(0, 0)))),
]

assert len({case.id for case in BAD}) == len(BAD), "duplicate case ids"
BASES = {"_".join(f"{k}={v}" for k, v in sorted(case.base.items())) or "default": case.base
         for case in BAD}


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------

class ComputationStarted(AssertionError):
    pass


@pytest.fixture
def no_compute(monkeypatch):
    """Any call reaching the reference forward fails: validation must come first."""
    def tripwire(*args, **kwargs):
        raise ComputationStarted("the forward ran before validation rejected the input")
    monkeypatch.setattr(msa_module, "naive_msa_forward", tripwire)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("base", list(BASES.values()), ids=list(BASES))
def test_valid_base_call_is_accepted(entry, base):
    """Control: every bad case's starting point is valid, so each failure below comes from the
    one thing its edit broke."""
    call = make_call(**base)
    if base is BLOCKS:  # the block_indices base also accepts given block ids
        call["block_indices"] = block_ids()()
    out, kl = invoke(ENTRY_POINTS[entry], call)
    assert out.shape == call["q"].shape and out.dtype == call["q"].dtype
    assert kl.dtype == torch.float32 and kl.dim() == 0 and torch.isfinite(kl)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_tripwire_catches_a_call_that_reaches_the_forward(entry, no_compute):
    """Control for ``no_compute``: a valid call does hit the patched forward."""
    with pytest.raises(ComputationStarted):
        invoke(ENTRY_POINTS[entry], make_call())


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", BAD, ids=lambda c: c.id)
def test_bad_input_is_rejected_naming_the_argument(entry, case, no_compute):
    call = case.build()
    with pytest.raises(case.exc, match=case.match) as info:
        invoke(ENTRY_POINTS[entry], call)
    assert type(info.value) is case.exc


def test_float64_rejected_by_the_kernel_backend(no_compute):
    call = make_call(dtype=torch.float64, backend="triton")
    with pytest.raises(ValueError, match=r"^q: expected dtype in \(.*\) for backend='triton' on "
                       r"cpu tensors .*, received torch\.float64$"):
        invoke(openmsa.msa_attention, call)


@pytest.mark.parametrize("entry,backend", [("msa_attention", "reference"),
                                           ("msa_attention", "auto"),
                                           ("naive_msa_attention", "reference"),
                                           ("naive_msa_attention", "auto")])
def test_float64_accepted_by_reference(entry, backend):
    """``backend="auto"`` runs the reference on CPU tensors, so it takes float64 too."""
    call = make_call(dtype=torch.float64, backend=backend)
    out, kl = invoke(ENTRY_POINTS[entry], call)
    assert out.dtype == torch.float64 and kl.dtype == torch.float32


def test_triton_backend_validates_before_reporting_unavailability(no_compute):
    with pytest.raises(ValueError, match=r"^top_k: .*received 0$"):
        invoke(openmsa.msa_attention, make_call(top_k=0, backend="triton"))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_validation_happens_before_computation_on_huge_inputs(entry, no_compute):
    """1M-token inputs built with expand (no memory behind them): a bad top_k must be rejected
    immediately, without the forward ever starting."""
    S = 1 << 20
    call = {name: torch.zeros(1, 1, h, 64).expand(1, S, h, 64)
            for name, h in dict(q=4, k=2, v=2, index_q=2, index_k=1).items()}
    call.update(top_k=65, block_size=128)
    with pytest.raises(ValueError, match=r"^top_k: expected an int in \[1, 64\], received 65$"):
        invoke(ENTRY_POINTS[entry], call)


def _nonleaf_inputs(call):
    """Replaces the five tensors by non-leaf views of fresh leaves requiring grad (so an in-place
    write would not be stopped by autograd) and returns the leaves."""
    leaves = {}
    for name in INPUTS:
        leaves[name] = call[name].clone().requires_grad_()
        call[name] = leaves[name] * 1.0
    return leaves


INPLACE_CASES = {
    "batched": dict(base=dict(B=2, S=70), options=dict(top_k=1, return_indices=True)),
    "packed": dict(base=dict(seqlens=(30, 40)), options=dict(top_k=1, return_indices=True,
                                                              max_seqlen=40)),
    "packed_4d": dict(base=dict(B=1, S=70), options=dict(top_k=1, return_indices=True),
                      cu_seqlens=(0, 33, 70)),
    "sink_and_local": dict(base=dict(B=1, S=200), options=dict(top_k=3, num_local_blocks=2,
                                                               num_sink_blocks=1,
                                                               return_indices=True)),
    "given_block_indices": dict(base=dict(B=1, S=70), options=dict(top_k=1, return_indices=True),
                                block_indices=True),
    "warmup": dict(base=dict(B=1, S=70), options=dict(warmup=True)),
    "query_range": dict(base=dict(seqlens=(30, 40), query_range=(20, 50)),
                        options=dict(top_k=1, return_indices=True, kl_num_queries=70)),
}


def _triton_msa_attention(*tensors, **options):
    return openmsa.msa_attention(*tensors, backend="triton", **options)


INPLACE_ENTRY_POINTS = dict(ENTRY_POINTS, msa_attention_triton=pytest.param(
    _triton_msa_attention, marks=pytest.mark.skipif(
        not msa_module.INTERPRETING, reason="needs TRITON_INTERPRET=1 (the README's test "
        "command)")))


@pytest.mark.parametrize("entry", INPLACE_ENTRY_POINTS.values(), ids=list(INPLACE_ENTRY_POINTS))
@pytest.mark.parametrize("name", INPLACE_CASES)
def test_valid_inputs_are_not_modified_in_place(entry, name):
    """On the reference and on the kernels (every tensor a kernel reads, cu_seqlens and
    block_indices too, keeps its bytes and its version counter)."""
    spec = INPLACE_CASES[name]
    call = make_call(**spec["base"], **spec["options"])
    if "cu_seqlens" in spec:
        call["cu_seqlens"] = torch.tensor(spec["cu_seqlens"], dtype=torch.int32)
    if spec.get("block_indices"):
        own = torch.arange(70).div(64, rounding_mode="floor")
        ids = torch.stack([own, torch.where(own > 0, 0, -1)], -1).expand(1, 2, 70, 2).clone()
        call["block_indices"] = ids
    leaves = _nonleaf_inputs(call)
    watched = {key: val for key, val in call.items() if isinstance(val, torch.Tensor)}
    snapshot = {key: val.detach().clone() for key, val in watched.items()}
    versions = {key: val._version for key, val in watched.items()}

    result = invoke(entry, call)
    out, kl = result[0], result[1]
    assert len(result) == (3 if call.get("return_indices") else 2)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ((out * grad_out).sum() + 2.0 * kl).backward()

    for key, val in watched.items():
        assert val._version == versions[key], f"{key} was written in place"
        # Bitwise: compare the raw bytes.
        assert torch.equal(val.detach().view(torch.uint8), snapshot[key].view(torch.uint8)), \
            f"{key} changed"
    for key, leaf in leaves.items():  # the backward really ran through every input
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), key


# --------------------------------------------------------------------------------------------
# Edge cases found while writing these tests
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arg", ["softmax_scale", "index_softmax_scale"])
def test_scale_overflowing_float_is_rejected_as_non_finite(arg, no_compute):
    with pytest.raises(ValueError, match=rf"^{arg}: expected a finite number"):
        invoke(openmsa.msa_attention, make_call(**{arg: 10**400}))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_packed_block_indices_beyond_their_sequence_are_rejected(entry, no_compute):
    call = make_call(seqlens=(64, 64), top_k=1)  # two sequences of one block each
    call["block_indices"] = torch.ones(2, 128, 1, dtype=torch.int32)  # block 1: out of range
    with pytest.raises(ValueError, match=r"^block_indices: expected entries in \[-1, own block"):
        invoke(ENTRY_POINTS[entry], call)


def test_head_dim_256_on_a_gpu_asks_for_the_reference_backend():
    """256 exceeds an H200's shared memory in the dQ kernel: a clear error, not a crash."""
    from openmsa.ops.msa import _check_gpu_head_dims

    with pytest.raises(ValueError, match="q: expected head dim in \\(64, 128\\).*reference"):
        _check_gpu_head_dims(torch.device("cuda"), q=256)
    _check_gpu_head_dims(torch.device("cuda"), q=128, index_q=64)
    _check_gpu_head_dims(torch.device("cpu"), q=256)  # the interpreter runs it
