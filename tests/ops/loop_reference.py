"""A slow, obviously-correct MSA: one Python loop iteration per (sequence, index head, query).

Independent of ``openmsa.ops.naive`` on purpose (no shared helpers): it follows SPEC section 3 word
for word on tiny inputs, in float64, with autograd for the gradients.
"""

from __future__ import annotations

import torch


def loop_msa(q, k, v, index_q, index_k, *, top_k=16, block_size=128, num_local_blocks=1,
             num_sink_blocks=0, warmup=False, cu_seqlens=None, softmax_scale=None,
             index_softmax_scale=None, local_block_dilation=1):
    """Inputs ``[B, S, heads, dim]`` or ``[T, heads, dim]`` with cu_seqlens (a list of offsets).

    Returns out (float64, q's shape), kl (float64 0-dim) and the kept block ids as a list of sets
    indexed ``[sequence][r][i]`` (None in warmup).
    """
    if cu_seqlens is None:
        sequences = [tuple(t[b] for t in (q, k, v, index_q, index_k)) for b in range(q.shape[0])]
    else:
        sequences = [tuple(t[a:b] for t in (q, k, v, index_q, index_k))
                     for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    num_index_heads, index_head_dim = index_q.shape[-2], index_q.shape[-1]
    num_index_kv_heads = index_k.shape[-2]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    index_scale = index_head_dim**-0.5 if index_softmax_scale is None else index_softmax_scale

    outs, kl_total, selections = [], 0.0, []
    num_queries = 0
    for sq, sk, sv, siq, sik in sequences:
        seqlen = sq.shape[0]
        num_queries += seqlen
        out = [[None] * num_heads for _ in range(seqlen)]
        seq_selection = [[None] * seqlen for _ in range(num_index_heads)]
        for r in range(num_index_heads):
            index_kv_head = r // (num_index_heads // num_index_kv_heads)
            main_heads = [h for h in range(num_heads) if h // (num_heads // num_index_heads) == r]
            for i in range(seqlen):
                # Step 1: index scores of the visible keys j <= i.
                z = index_scale * (sik[:i + 1, index_kv_head] @ siq[i, r])  # [i + 1]
                if warmup:
                    kept_keys = list(range(i + 1))
                else:
                    # Step 2: block max over visible keys.
                    own = i // block_size
                    block_score = {n: z[n * block_size:(n + 1) * block_size].max().item()
                                   for n in range(own + 1)}
                    # Step 3: forced blocks: own - m * d for m < num_local_blocks, and sinks.
                    local = {own - m * local_block_dilation for m in range(num_local_blocks)}
                    forced = {n for n in range(own + 1) if n in local or n < num_sink_blocks}
                    # Step 4: then the best remaining blocks, ties to the lower id.
                    rest = sorted((n for n in block_score if n not in forced),
                                  key=lambda n: (-block_score[n], n))
                    kept = set(forced) | set(rest[:max(0, top_k - len(forced))])
                    seq_selection[r][i] = kept
                    # Step 5.
                    kept_keys = [j for j in range(i + 1) if j // block_size in kept]
                # Step 6: main attention of the index head's main heads over the kept keys.
                probs = []
                for h in main_heads:
                    kv_head = h // (num_heads // num_kv_heads)
                    logits = scale * (sk[kept_keys, kv_head] @ sq[i, h])
                    p = torch.softmax(logits, dim=0)
                    out[i][h] = p @ sv[kept_keys, kv_head]
                    probs.append(p)
                # Step 7: KL(teacher || student) on the kept keys.
                teacher = torch.stack(probs).mean(dim=0).detach()
                student = torch.softmax(z[kept_keys], dim=0)
                positive = teacher > 0
                kl_total = kl_total + (teacher[positive]
                                       * torch.log(teacher[positive] / student[positive])).sum()
        outs.append(torch.stack([torch.stack(row) for row in out]))
        selections.append(seq_selection)
    out = torch.cat(outs) if cu_seqlens is not None else torch.stack(outs)
    kl = kl_total / (num_queries * num_index_heads)
    return out, kl, (None if warmup else selections)
