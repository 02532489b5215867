"""Helpers to compare an MSA implementation with the reference (used by tests and ``openmsa check``)."""

from __future__ import annotations

import datetime
import gc
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .ops.auto_tuning import route
from .ops.configs import Tuning
from .ops.custom_ops import tuned_msa_forward
from .ops.msa import msa_kernels, naive_msa_attention
from .ops.naive import naive_msa_forward
from .ops.validate import validate_block_indices, validate_msa_args

INPUT_NAMES = ("q", "k", "v", "index_q", "index_k")
QUANTITY_NAMES = ("out", "kl") + tuple(f"d{name}" for name in INPUT_NAMES)
# An error passes when it is at most twice the error of the reference computing in the same
# dtype, or below this floor (for quantities the two compute identically).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


@dataclass
class MSACase:
    """One problem shape; ``seqlens`` set means packed input with those sequence lengths."""

    name: str
    batch: int = 1
    seqlen: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    num_index_heads: int = 2
    num_index_kv_heads: int = 1
    head_dim: int = 64
    index_head_dim: int = 64
    seqlens: tuple[int, ...] | None = None
    options: dict = field(default_factory=dict)  # keyword arguments of msa_attention

    def shape_label(self) -> str:
        tokens = f"T={sum(self.seqlens)} packed" if self.seqlens else f"B={self.batch} S={self.seqlen}"
        return (f"{tokens} H{self.num_heads}/{self.num_kv_heads} Hi{self.num_index_heads}/"
                f"{self.num_index_kv_heads} D{self.head_dim}/{self.index_head_dim}")


def random_inputs(case: MSACase, dtype: torch.dtype, device, seed: int = 0):
    """Random q, k, v, index_q, index_k (requiring grad) and cu_seqlens (or None)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    if case.seqlens:
        lead = (sum(case.seqlens),)
        offsets = torch.tensor([0, *case.seqlens], dtype=torch.int64).cumsum(0)
        cu_seqlens = offsets.to(torch.int32).to(device)
    else:
        lead = (case.batch, case.seqlen)
        cu_seqlens = None
    shapes = ((case.num_heads, case.head_dim), (case.num_kv_heads, case.head_dim),
              (case.num_kv_heads, case.head_dim), (case.num_index_heads, case.index_head_dim),
              (case.num_index_kv_heads, case.index_head_dim))
    tensors = [torch.randn(*lead, *shape, generator=generator).to(device=device, dtype=dtype)
               .requires_grad_() for shape in shapes]
    return tensors, cu_seqlens


def run_with_grads(fn, inputs, cu_seqlens, out_grad, kl_weight: float, **options):
    """Runs ``fn`` (an msa_attention-like function), back-propagates ``<out, out_grad> +
    kl_weight * kl`` and returns ``(values, indices)``: values maps QUANTITY_NAMES to tensors."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    result = fn(*inputs, cu_seqlens=cu_seqlens, **options)
    out, kl = result[0], result[1]
    indices = result[2] if len(result) > 2 else None
    loss = (out.double() * out_grad.double()).sum() + kl_weight * kl.double()
    grads = torch.autograd.grad(loss, inputs)
    values = {"out": out.detach(), "kl": kl.detach()}
    values.update({f"d{name}": grad for name, grad in zip(INPUT_NAMES, grads)})
    return values, indices


def run_query_ranges(fn, inputs, cu_seqlens, out_grad, kl_weight: float, ranges, **options):
    """``run_with_grads`` once per query range ``(first, end)`` of packed (or batch-of-one)
    ``inputs``: ``fn`` gets q and index_q cut to the range, every key, ``query_start=first`` and
    the KL's count of all tokens (context parallelism's building block). Returns one
    ``(values, indices)`` per range; ``values["out"]`` is zero outside the range, so that the
    ranges' values and gradients add up to those of one run over every query."""
    total = inputs[0].shape[-3]
    results = []
    for first, end in ranges:
        def on_range(q, k, v, index_q, index_k, **opts):
            out, *rest = fn(q[..., first:end, :, :], k, v, index_q[..., first:end, :, :],
                            index_k, query_start=first, kl_num_queries=total, **opts)
            padding = [out.new_zeros(*out.shape[:-3], n, *out.shape[-2:])
                       for n in (first, total - end)]
            return (torch.cat([padding[0], out, padding[1]], dim=-3), *rest)

        results.append(run_with_grads(on_range, inputs, cu_seqlens, out_grad, kl_weight,
                                      **options))
    return results


def rel_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (absolute error if expected is 0)."""
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).norm().item()
    scale = expected.norm().item()
    return diff / scale if scale > 0 else diff


def same_block_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows (all but the last dim) where the two id lists hold the same set (order ignored)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


@dataclass
class Comparison:
    errors: dict  # quantity -> rel RMS error vs the high-precision reference
    baseline_errors: dict  # quantity -> rel RMS error of the reference run in the test dtype
    selection_agreement: float | None  # share of rows whose kept sets match the reference's

    def passed(self, tolerance: float, baseline_factor: float = 2.0) -> bool:
        """FlashAttention's rule: error at most ``baseline_factor`` x the reference's own error in
        the same dtype, or below ``tolerance``."""
        return all(err <= max(tolerance, baseline_factor * self.baseline_errors[name])
                   for name, err in self.errors.items())


def _reference_computing_in_input_dtype(q, k, v, index_q, index_k, *, cu_seqlens=None,
                                        block_indices=None, return_indices=False,
                                        tuning=None, **options):
    """The reference with every matmul and softmax in the inputs' dtype (FlashAttention's
    baseline: what the same math costs in that precision). ``tuning`` is validated and, as in
    ``naive_msa_attention``, changes nothing: the reference has no kernel routes."""
    route(tuning)
    problem = validate_msa_args(q, k, v, index_q, index_k, **msa_options(
        dict(options, cu_seqlens=cu_seqlens, return_indices=return_indices, backend="reference")))
    return naive_msa_forward(q, k, v, index_q, index_k, problem, cu_seqlens, block_indices,
                             compute_dtype=q.dtype)


def msa_options(options: dict) -> dict:
    """Every keyword argument ``validate_msa_args`` takes: ``msa_attention``'s defaults with
    ``options`` over them."""
    defaults = dict(top_k=16, block_size=128, softmax_scale=None, index_softmax_scale=None,
                    num_local_blocks=1, num_sink_blocks=0, warmup=False, cu_seqlens=None,
                    max_seqlen=None, deterministic=False, return_indices=False, backend="auto",
                    query_start=None, kl_num_queries=None, kl_value=True,
                    index_precision="input", local_block_dilation=1)
    return dict(defaults, **options)


def compare_with_reference(fn, case: MSACase, dtype: torch.dtype, device, seed: int = 0,
                           kl_weight: float = 1.0, **extra_options) -> Comparison:
    """Runs ``fn`` in ``dtype`` and the reference in high precision (float64 on CPU, float32 on
    GPU) and in ``dtype``, all on ``fn``'s kept blocks, and returns the relative errors.
    ``extra_options``: more keyword arguments of every run (e.g. ``kl_value=False``)."""
    device = torch.device(device)
    high = torch.float64 if device.type == "cpu" else torch.float32
    inputs, cu_seqlens = random_inputs(case, dtype, device, seed)
    lead = inputs[0].shape[:-2]
    out_grad = torch.randn(*lead, case.num_heads, case.head_dim,
                           generator=torch.Generator().manual_seed(seed + 1)).to(device)
    warmup = case.options.get("warmup", False)
    options = dict(case.options, return_indices=not warmup, **extra_options)
    values, indices = run_with_grads(fn, inputs, cu_seqlens, out_grad, kl_weight, **options)

    agreement = None
    reference_options = dict(options)
    if indices is not None:
        _, ref_indices = run_with_grads(naive_msa_attention, [t.to(high) for t in inputs],
                                        cu_seqlens, out_grad, kl_weight, **options)
        agreement = same_block_sets(indices, ref_indices).float().mean().item()
        reference_options = dict(options, block_indices=indices)
    expected, _ = run_with_grads(naive_msa_attention, [t.to(high) for t in inputs], cu_seqlens,
                                 out_grad, kl_weight, **reference_options)
    low, _ = run_with_grads(_reference_computing_in_input_dtype, inputs, cu_seqlens, out_grad,
                            kl_weight, **reference_options)
    errors = {name: rel_rms_error(values[name], expected[name]) for name in QUANTITY_NAMES}
    baseline = {name: rel_rms_error(low[name], expected[name]) for name in QUANTITY_NAMES}
    return Comparison(errors, baseline, agreement)


def tuned_msa_attention(tuning: Tuning):
    """``msa_attention`` (``backend="triton"``) with other work-list and key-outer sizes: the
    kernels as they run on long sequences, at test sizes (several segments per key block,
    several steps per segment)."""
    operator = tuned_msa_forward(tuning)

    def run(q, k, v, index_q, index_k, *, block_indices=None, **options):
        arguments = msa_options(dict(options, backend="triton"))
        problem = validate_msa_args(q, k, v, index_q, index_k, **arguments)
        if block_indices is not None:
            validate_block_indices(block_indices, problem, arguments["cu_seqlens"], q.device)
        return msa_kernels(operator, q, k, v, index_q, index_k, problem,
                           arguments["cu_seqlens"], arguments["max_seqlen"], block_indices,
                           arguments["kl_value"], arguments["deterministic"],
                           arguments["return_indices"], tuning)

    return run


@contextmanager
def gloo_test_process(rank: int, world: int, init_file: str, failures):
    """A spawned test process inside a gloo group of ``world``; an error raised inside goes to
    the ``failures`` queue (the parent fails the test on it).

    The process leaves as gloo lets it leave cleanly: autograd graphs that hold the group are
    collected and every rank meets at a barrier before the group is destroyed, and the process
    exits without the interpreter's teardown, where gloo's threads now and then aborted it
    (SIGABRT, "terminate called without an active exception")."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=5))
    failed = False
    try:
        yield
    except Exception as error:
        failed = True
        failures.put(f"rank {rank}: {type(error).__name__}: {error}"[:3000])
    finally:
        gc.collect()
        # A failed rank leaves at once, so that peers waiting on it fail rather than hang.
        if not failed:
            try:
                dist.barrier()
            except Exception as error:  # a peer failed and left
                failures.put(f"rank {rank}: the closing barrier: {error}"[:3000])
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
