"""A small GQA transformer for the retrieval task, with MSA or dense causal attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.msa_attention import MSAAttention, apply_rope
from .task import RetrievalTask


class DenseAttention(nn.Module):
    """The baseline: the same projections and RoPE, dense causal GQA attention (PyTorch SDPA)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float = 10000.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, return_indices: bool = False):
        """Returns ``(hidden, zero KL)`` (``+ (None,)`` with ``return_indices``)."""
        batch, seqlen, _ = x.shape
        positions = torch.arange(seqlen, device=x.device).expand(batch, seqlen)
        q = apply_rope(self.q_proj(x).view(batch, seqlen, self.num_heads, self.head_dim),
                       positions, self.rope_theta)
        k = apply_rope(self.k_proj(x).view(batch, seqlen, self.num_kv_heads, self.head_dim),
                       positions, self.rope_theta)
        v = self.v_proj(x).view(batch, seqlen, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        hidden = self.o_proj(out.transpose(1, 2).reshape(batch, seqlen, -1))
        return (hidden, x.new_zeros(()), None) if return_indices else (hidden, x.new_zeros(()))


class Block(nn.Module):
    def __init__(self, attention: nn.Module, hidden_size: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.attention = attention
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
                                 nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x, return_indices=False):
        if return_indices:
            hidden, kl, indices = self.attention(self.attention_norm(x), return_indices=True)
        else:
            (hidden, kl), indices = self.attention(self.attention_norm(x)), None
        x = x + hidden
        return x + self.mlp(self.mlp_norm(x)), kl, indices


class RetrievalModel(nn.Module):
    """Embeds (key, value) token pairs, runs ``layers`` blocks, reads the answer at the last
    token. ``attention``: "msa" or "dense"."""

    def __init__(self, task: RetrievalTask, attention: str, hidden_size: int = 128,
                 layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                 top_k: int = 2, block_size: int = 64, rope_theta: float = 10000.0,
                 index_precision: str = "input", share_index_every: int = 1,
                 num_local_blocks: int = 1, local_block_dilation: int = 1,
                 share_index_kl: bool = False):
        super().__init__()
        if not isinstance(share_index_every, int) or share_index_every < 1:
            raise ValueError(f"share_index_every: expected an int >= 1, received "
                             f"{share_index_every!r}")
        self.key_embedding = nn.Embedding(task.vocab_keys, hidden_size)
        self.value_embedding = nn.Embedding(task.vocab_values, hidden_size)
        self.blocks = nn.ModuleList()
        for layer in range(layers):
            if attention == "dense":
                made = DenseAttention(hidden_size, num_heads, num_kv_heads, head_dim,
                                      rope_theta=rope_theta)
            else:  # layers 0, N, 2N, ... select; the others share the selection before them
                source = (None if layer % share_index_every == 0
                          else self.blocks[layer - layer % share_index_every].attention)
                made = MSAAttention(hidden_size, num_heads, num_kv_heads, head_dim,
                                    top_k=top_k, block_size=block_size, rope_theta=rope_theta,
                                    index_precision=index_precision, share_index_from=source,
                                    num_local_blocks=num_local_blocks,
                                    local_block_dilation=local_block_dilation,
                                    share_index_kl=share_index_kl and source is not None)
            self.blocks.append(Block(made, hidden_size))
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.head = nn.Linear(hidden_size, task.num_values)

    def forward(self, tokens, return_indices=False):
        """Returns answer logits ``[B, num_values]``, the mean KL over the layers whose KL
        trains an index branch (``MSAAttention.has_kl``; every layer for dense attention, whose
        KL is 0) and, with ``return_indices``, each layer's kept block ids (None for dense or
        warmup layers)."""
        keys, values = tokens
        x = self.key_embedding(keys) + self.value_embedding(values)
        kls, indices = [], []
        for block in self.blocks:
            x, kl, layer_indices = block(x, return_indices)
            if getattr(block.attention, "has_kl", True):
                kls.append(kl)
            indices.append(layer_indices)
        logits = self.head(self.norm(x[:, -1]))
        kl = torch.stack(kls).mean()
        return (logits, kl, indices) if return_indices else (logits, kl)
