"""``openmsa bench --decode``: one decode step of one attention layer (one new token per
sequence) with ``msa_decode`` against dense decoding over the whole cache (PyTorch SDPA), in the
same run, at each context length and batch size, next to each one's memory-bandwidth floor.

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


def measure(row, args) -> dict:
    """Times one decode step (MSA, dense) of ``row``'s shape on the GPU."""
    import torch
    import torch.nn.functional as F

    from ..ops.decode import msa_decode
    from .selection import index_inputs
    from .timing import median_ms

    heads, kv_heads, index_heads = row["heads"]
    batch, context, dim = row["batch"], row["context"], row["head_dim"]
    generator = torch.Generator(device="cuda").manual_seed(context + batch)
    q = torch.randn(batch, 1, heads, dim, device="cuda", generator=generator).bfloat16()
    k, v = (torch.randn(batch, context, kv_heads, dim, device="cuda",
                        generator=generator).bfloat16() for _ in range(2))
    index_q, index_k = index_inputs(args.selection, context, index_heads, dim, generator,
                                    "cuda")
    index_q = index_q[None, -1:].expand(batch, 1, index_heads, dim).contiguous()
    index_k = index_k[None].expand(batch, context, 1, dim).contiguous()
    lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    options = dict(top_k=args.top_k, block_size=args.block_size,
                   index_precision=args.index_precision)
    result = dict(row, heads=f"H{heads}/Hkv{kv_heads}/Hi{index_heads}")
    result["msa_ms"] = median_ms(lambda: msa_decode(q, k, v, index_q, index_k, lengths,
                                                    **options))
    q_heads, k_heads, v_heads = (t.transpose(1, 2) for t in (q, k, v))
    result["dense_ms"] = median_ms(lambda: F.scaled_dot_product_attention(
        q_heads, k_heads, v_heads, enable_gqa=True))
    result["speedup_vs_dense"] = result["dense_ms"] / result["msa_ms"]
    result["msa_vs_floor"] = result["msa_ms"] / result["msa_floor_ms"]
    return result


def print_table(rows) -> None:
    """The plan's floors, and the measured times where a row has them."""
    def cell(row, key, fmt):
        return format(row[key], fmt) if key in row else "-"

    print(f"{'context':>8} {'batch':>5} {'MSA ms':>8} {'floor':>7} {'x floor':>7} "
          f"{'dense ms':>9} {'floor':>7} {'MSA vs dense':>12}")
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>5} {cell(r, 'msa_ms', '.3f'):>8} "
              f"{r['msa_floor_ms']:>7.3f} {cell(r, 'msa_vs_floor', '.2f'):>7} "
              f"{cell(r, 'dense_ms', '.3f'):>9} {r['dense_floor_ms']:>7.3f} "
              f"{cell(r, 'speedup_vs_dense', '.2f'):>12}")
