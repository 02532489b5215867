"""``openmsa bench --decode``: one decode step of one attention layer (one new token per
sequence) with ``msa_decode`` against dense decoding over the whole cache (PyTorch SDPA), in the
same run, at each context length and batch size, next to each one's memory-bandwidth floor.

Both steps are CUDA graph replays timed with the L2 cache made cold by reading a 256 MB buffer
before each call (``timing.median_ms_read_flushed``); ``*_write_flush_ms`` are the same
replays timed as the training benchmarks are (``timing.median_ms``: a zero-filled buffer,
whose dirty lines cost each call about 9 us of write-back: a fixed cost that is no part of
either step, but which weighs on the short MSA step more than on dense).

The floor is the bytes the step must read at 4 TB/s (the H200's HBM, GPU.md): MSA reads the
cached index keys (``B x S x Hik x Di``) and at most ``top_k`` blocks of K and V per index head
(``B x Hi x top_k x block x D x 2``, fewer where index heads of a KV head keep the same
blocks); dense decoding reads every cached K and V (``B x S x Hkv x D x 2``); bf16, 2 bytes
each. Index keys come from one selection kind (openmsa.bench.selection).
"""

from __future__ import annotations

HBM_BYTES_PER_S = 4.0e12
ELEMENT_BYTES = 2  # bf16


def decode_bytes(batch: int, context: int, heads: tuple[int, int, int], head_dim: int,
                 top_k: int, block_size: int) -> dict:
    """Bytes one decode step must read: MSA (index keys + kept K/V blocks, an upper bound) and
    dense (the whole K/V cache)."""
    _, kv_heads, index_heads = heads
    kept = min(top_k * block_size, context)
    msa = batch * (context * head_dim + index_heads * kept * head_dim * 2) * ELEMENT_BYTES
    dense = batch * context * kv_heads * head_dim * 2 * ELEMENT_BYTES
    return dict(msa_bytes=msa, dense_bytes=dense,
                msa_floor_ms=msa / HBM_BYTES_PER_S * 1e3,
                dense_floor_ms=dense / HBM_BYTES_PER_S * 1e3)


def plan(args, heads) -> list[dict]:
    return [dict(context=context, batch=batch, heads=heads, head_dim=args.head_dim,
                 top_k=args.top_k, block_size=args.block_size,
                 **decode_bytes(batch, context, heads, args.head_dim, args.top_k,
                                args.block_size))
            for context in args.seqlens for batch in args.batches]


def measure(row, args) -> list[dict]:
    """Times one decode step of ``row``'s shape on the GPU: dense SDPA over the whole cache once,
    and ``msa_decode`` on each selection kind of ``args.selections``. Both are timed as CUDA
    graph replays (how a server runs a decode step: without the host's launch costs) and
    ``msa_decode`` also eagerly."""
    import torch
    import torch.nn.functional as F

    from ..ops.decode import msa_decode
    from .options import msa_options
    from .selection import index_inputs
    from .timing import graphed, median_ms, median_ms_read_flushed

    heads, kv_heads, index_heads = row["heads"]
    batch, context, dim = row["batch"], row["context"], row["head_dim"]
    generator = torch.Generator(device="cuda").manual_seed(context + batch)
    q = torch.randn(batch, 1, heads, dim, device="cuda", generator=generator).bfloat16()
    k, v = (torch.randn(batch, context, kv_heads, dim, device="cuda",
                        generator=generator).bfloat16() for _ in range(2))
    lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    options = msa_options(args)
    q_heads, k_heads, v_heads = (t.transpose(1, 2) for t in (q, k, v))
    dense = graphed(lambda: F.scaled_dot_product_attention(q_heads, k_heads, v_heads,
                                                           enable_gqa=True))
    dense_ms, dense_write_flush_ms = median_ms_read_flushed(dense), median_ms(dense)
    results = []
    for kind in args.selections:
        index_q, index_k = index_inputs(kind, context, index_heads, dim, generator, "cuda")
        index_q = index_q[None, -1:].expand(batch, 1, index_heads, dim).contiguous()
        index_k = index_k[None].expand(batch, context, 1, dim).contiguous()

        def step():
            return msa_decode(q, k, v, index_q, index_k, lengths, **options)

        _, ids = msa_decode(q, k, v, index_q, index_k, lengths, return_indices=True, **options)
        result = dict(row, heads=f"H{heads}/Hkv{kv_heads}/Hi{index_heads}", selection=kind,
                      kept_blocks=float((ids >= 0).sum(-1).float().mean()),
                      dense_ms=dense_ms, dense_write_flush_ms=dense_write_flush_ms,
                      msa_eager_ms=median_ms(step))
        replay = graphed(step)
        result["msa_ms"] = median_ms_read_flushed(replay)
        result["msa_write_flush_ms"] = median_ms(replay)
        result["speedup_vs_dense"] = dense_ms / result["msa_ms"]
        result["speedup_vs_dense_write_flush"] = dense_write_flush_ms / result["msa_write_flush_ms"]
        result["msa_vs_floor"] = result["msa_ms"] / result["msa_floor_ms"]
        results.append(result)
    return results


def measure_prefill(context: int, heads, args) -> dict:
    """A ``context``-token prompt through ``msa_decode`` (the cache path: all tokens new, the
    training kernels with query ranges) against the training forward (``msa_attention`` with
    inputs that need gradients, KL included), one sequence, ``args.selections[0]``."""
    import torch

    from ..ops.decode import msa_decode
    from ..ops.msa import msa_attention
    from .options import msa_options
    from .selection import index_inputs
    from .timing import median_ms

    num_heads, kv_heads, index_heads = heads
    dim = args.head_dim
    generator = torch.Generator(device="cuda").manual_seed(context)
    q = torch.randn(1, context, num_heads, dim, device="cuda", generator=generator).bfloat16()
    k, v = (torch.randn(1, context, kv_heads, dim, device="cuda",
                        generator=generator).bfloat16() for _ in range(2))
    index_q, index_k = (t[None] for t in index_inputs(args.selections[0], context, index_heads,
                                                      dim, generator, "cuda"))
    lengths = torch.full((1,), context, dtype=torch.int32, device="cuda")
    options = msa_options(args)
    prefill_ms = median_ms(lambda: msa_decode(q, k, v, index_q, index_k, lengths, **options))
    leaves = [t.detach().requires_grad_() for t in (q, k, v, index_q, index_k)]
    forward_ms = median_ms(lambda: msa_attention(*leaves, **options))
    return dict(context=context, selection=args.selections[0], prefill_ms=prefill_ms,
                training_forward_ms=forward_ms, prefill_vs_forward=prefill_ms / forward_ms)


def print_table(rows) -> None:
    """The plan's floors, and the measured times where a row has them."""
    def cell(row, key, fmt):
        return format(row[key], fmt) if key in row else "-"

    print(f"{'context':>8} {'batch':>5} {'selection':>9} {'MSA ms':>8} {'floor':>7} "
          f"{'x floor':>7} {'dense ms':>9} {'floor':>7} {'MSA vs dense':>12} "
          f"{'(write flush)':>13}")
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>5} {r.get('selection', '-'):>9} "
              f"{cell(r, 'msa_ms', '.3f'):>8} "
              f"{r['msa_floor_ms']:>7.3f} {cell(r, 'msa_vs_floor', '.2f'):>7} "
              f"{cell(r, 'dense_ms', '.3f'):>9} {r['dense_floor_ms']:>7.3f} "
              f"{cell(r, 'speedup_vs_dense', '.2f'):>12} "
              f"{cell(r, 'speedup_vs_dense_write_flush', '.2f'):>13}")
