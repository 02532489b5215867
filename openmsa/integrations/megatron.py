"""openmsa in Megatron-core: an MSA self-attention for ``GPTModel``'s local (non-TransformerEngine)
layer spec.

``get_gpt_layer_msa_spec(...)`` is ``get_gpt_layer_local_spec`` with the self-attention swapped:
Megatron's own q/k/v and output projections, QK-norm and RoPE stay as Megatron applies them; the
core attention slot runs ``msa_attention``, and an index branch (one index head per query group,
one index key head, head dim ``kv_channels``) reads the layer's input detached, with the same
RoPE. Megatron's layout is sequence-first (``[s, b, ...]``); the module transposes to openmsa's.

The KL reaches the training loss without a change to it: each layer's attention output carries
``kl_weight * kl`` into the backward (``KLIntoBackward``, as Megatron's MoE layers carry their
auxiliary losses), times ``KLIntoBackward.backward_scale``, which a training loop sets to the
factor its main loss is scaled by in the backward (loss scale / micro-batches; 1 by default).
Each layer's last KL value is kept in ``last_kl`` for logging (``megatron_msa_kl(model)``).

Index sharing (SPEC section 9): ``get_gpt_layer_msa_spec(share_index_every=N)`` gives layers
1, 1 + N, ... an index branch; the others have none and attend over the nearest earlier such
layer's kept blocks (``sparse_attention``, no KL), once ``link_index_sharing(model)`` has
linked them after the model is built.

Warmup: ``openmsa.set_msa_warmup(model, True)`` / ``MSAWarmupSchedule`` switch these layers too.

Packed sequences: ``PackedSeqParams`` in THD format (``cu_seqlens_q``, equal to the key offsets,
without padding inside the packing) run as ``msa_attention``'s ``cu_seqlens``: each sequence
attends, selects and counts in the KL as if alone.

Context parallelism: Megatron's context-parallel group runs ``context_parallel_msa_attention``
in sequence mode, whose zig-zag shards are Megatron's load-balanced ones; every rank's ``kl``
is the whole sequence's and its gradient the rank's share, so ``KLIntoBackward.backward_scale``
is, as for the main loss, what Megatron's schedule scales the loss by (context-parallel size /
micro-batches). Packed input with context parallelism splits each sequence on its own, as
Megatron does (``packed_split="sequence"``: every sequence's length a multiple of 2 x CP).

Tensor parallelism: each rank owns whole query groups (``num_query_groups`` a multiple of the
tensor-parallel size) with their index query heads (a column-parallel index projection); the
one index key head is every rank's, its gradient summed over the ranks; each rank's KL is its
index heads' mean and carries ``kl_weight / tensor-parallel size`` into the backward, so the
gradients are those of the model's KL, the mean over all index heads
(``docs/PRODUCTION.md``, Megatron-core).
``megatron-core`` is an optional dependency: importing this module without it says so.
"""

from __future__ import annotations

import torch
from torch import nn

from ..context_parallel import (context_parallel_msa_attention,
                                context_parallel_sparse_attention)
from ..ops.msa import msa_attention, sparse_attention

try:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
except ImportError as error:  # an optional dependency
    raise ImportError("openmsa.integrations.megatron needs Megatron-core: pip install "
                      "megatron-core (or pip install -e \".[megatron]\")") from error


class KLIntoBackward(torch.autograd.Function):
    """``out`` unchanged; its backward also sends ``weight * backward_scale`` into ``kl``, as if
    ``weight * kl`` had been added to the (scaled) loss."""

    backward_scale = 1.0  # set by the training loop: its main loss's backward scale

    @staticmethod
    def forward(ctx, out, kl, weight: float):
        ctx.weight = weight
        ctx.kl_shape, ctx.kl_dtype, ctx.kl_device = kl.shape, kl.dtype, kl.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        kl_grad = torch.full(ctx.kl_shape, ctx.weight * KLIntoBackward.backward_scale,
                             dtype=ctx.kl_dtype, device=ctx.kl_device)
        return grad_out, kl_grad, None


class MSACoreAttention(MegatronModule):
    """Megatron's core-attention slot running ``msa_attention``: queries ``[s, b, H, D]``, keys
    and values ``[s, b, Hkv, D]`` after Megatron's RoPE; returns ``[s, b, H * D]``. The index
    projections live here; ``MSASelfAttention`` hands over the detached layer input and the
    rotary frequencies before each call."""

    is_msa_layer = True  # openmsa.set_msa_warmup / MSAWarmupSchedule switch it

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, *, top_k: int = 16, block_size: int = 128,
                 num_local_blocks: int = 1, num_sink_blocks: int = 0,
                 index_precision: str = "input", kl_weight: float = 1.0,
                 backend: str = "auto", warmup: bool = False, share_index_every: int = 1):
        super().__init__(config=config)
        groups = config.num_query_groups or config.num_attention_heads
        tensor_parallel = config.tensor_model_parallel_size
        if groups % tensor_parallel:
            raise ValueError(f"config.num_query_groups: expected a multiple of "
                             f"tensor_model_parallel_size ({tensor_parallel}: each rank owns "
                             f"whole GQA groups with their index heads), received {groups}")
        if config.sequence_parallel:
            raise ValueError("config.sequence_parallel: expected False (the index branch reads "
                             "the whole sequence of the layer's input; this version does not "
                             "gather a sequence-parallel one), received True")
        # Context parallelism: openmsa's sequence mode, whose zig-zag split (2 x CP chunks,
        # rank r holding chunks r and 2 x CP - 1 - r) is Megatron's load-balanced one.
        self.cp_group = getattr(pg_collection, "cp", None)
        self.tp_group = getattr(pg_collection, "tp", None)
        self.tensor_parallel_size = tensor_parallel
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"config.attention_dropout: expected 0.0 (MSA has no attention "
                             f"dropout), received {dropout}")
        self.num_query_groups = groups // tensor_parallel  # this rank's, one index head each
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale
        self.kl_weight = kl_weight
        self.warmup = warmup
        self.options = dict(top_k=top_k, block_size=block_size,
                            num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks,
                            index_precision=index_precision, backend=backend)
        _check_share_index_every(share_index_every)
        self.layer_number = layer_number
        # Layers 1, 1 + N, 1 + 2N, ... (Megatron counts from 1) have an index branch; the
        # others attend over the kept blocks of the nearest earlier one (SPEC section 9),
        # linked by ``link_index_sharing``.
        self.has_index_branch = (layer_number - 1) % share_index_every == 0
        self.index_source = None  # a sharing layer's indexer, in a list (not a submodule)
        self.hands_on_indices = False  # an indexer whose ids a later layer reads
        self.last_indices = None
        if self.has_index_branch:
            # Tensor parallelism: the index query heads split with their query groups (a
            # column-parallel projection); the one index key head is every rank's, its
            # gradient summed over the ranks (``_index_branch``).
            self.index_q_proj = ColumnParallelLinear(
                config.hidden_size, groups * self.head_dim, config=config,
                init_method=config.init_method, bias=False, gather_output=False,
                tp_group=self.tp_group)
            self.index_k_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.index_inputs = None  # (detached hidden [s, b, h], rotary freqs or None)
        self.last_kl = None

    def _index_branch(self, cu_seqlens=None):
        """index_q ``[s, b, Hi, Di]`` and index_k ``[s, b, 1, Di]`` with the layer's RoPE; packed
        (``cu_seqlens``: Megatron's THD format, batch 1) ``[t, Hi, Di]`` and ``[t, 1, Di]``,
        positions counted from each sequence's start as Megatron's RoPE counts them."""
        hidden, rotary = self.index_inputs
        seqlen, batch = hidden.shape[:2]
        index_q = self.index_q_proj(hidden)[0].view(seqlen, batch, self.num_query_groups,
                                                    self.head_dim)
        # Identity forward; the backward sums the ranks' gradients (each rank's KL reaches
        # the shared index key head through its own index heads only).
        index_k = copy_to_tensor_model_parallel_region(self.index_k_proj(hidden),
                                                       group=self.tp_group)
        index_k = index_k.view(seqlen, batch, 1, self.head_dim)
        if cu_seqlens is not None:
            index_q, index_k = index_q.squeeze(1), index_k.squeeze(1)
        if rotary is not None:  # as Megatron rotates q and k (packed: per sequence, per CP rank)
            index_q = apply_rotary_pos_emb(index_q, rotary[0], config=self.config,
                                           cu_seqlens=cu_seqlens, cp_group=self.cp_group)
            index_k = apply_rotary_pos_emb(index_k, rotary[1], config=self.config,
                                           cu_seqlens=cu_seqlens, cp_group=self.cp_group)
        return index_q, index_k

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        cu_seqlens, max_seqlen = _packed_offsets(packed_seq_params)
        if attention_bias is not None:
            raise ValueError("attention_bias: expected None (MSA attends causally over its "
                             "kept blocks), received a tensor")
        if not self.has_index_branch:
            return self._shared_attention(query, key, value, cu_seqlens, max_seqlen)
        if self.index_inputs is None:
            raise ValueError("MSACoreAttention: no index inputs (it runs inside "
                             "MSASelfAttention, which hands them over)")
        index_q, index_k = self._index_branch(cu_seqlens)
        self.index_inputs = None
        q, k, v, index_q, index_k = _openmsa_layout(
            (query, key, value, index_q, index_k), value.dtype, cu_seqlens)
        wants_indices = self.hands_on_indices and not self.warmup
        options = dict(self.options, softmax_scale=self.softmax_scale, warmup=self.warmup,
                       cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                       return_indices=wants_indices)
        out, kl, *indices = self._run(msa_attention, context_parallel_msa_attention,
                                      (q, k, v, index_q, index_k), options)
        self.last_indices = indices[0] if indices else None
        self.last_kl = kl.detach()
        out = _megatron_layout(out, query)
        if torch.is_grad_enabled() and self.kl_weight and kl.requires_grad:
            # With tensor parallelism each rank's kl is its index heads' mean, the model's the
            # mean over ranks.
            out = KLIntoBackward.apply(out, kl, self.kl_weight / self.tensor_parallel_size)
        return out

    def _run(self, plain, context_parallel, tensors, options):
        """``plain(*tensors, **options)``, or with Megatron's context parallelism its
        ``context_parallel`` form in sequence mode on this rank's shards (packed input split
        per sequence, as Megatron splits it)."""
        if self.config.context_parallel_size == 1:
            return plain(*tensors, **options)
        if self.cp_group is None:
            from megatron.core import parallel_state
            self.cp_group = parallel_state.get_context_parallel_group()
        packed_split = "packing" if options.get("cu_seqlens") is None else "sequence"
        return context_parallel(*tensors, group=self.cp_group, mode="sequence",
                                packed_split=packed_split, **options)

    def _shared_attention(self, query, key, value, cu_seqlens, max_seqlen):
        """A layer without an index branch: the main attention over its indexer's latest kept
        blocks (dense in warmup), no KL."""
        self.index_inputs = None
        if self.index_source is None:
            raise ValueError(f"MSACoreAttention (layer {self.layer_number}): shares an earlier "
                             f"layer's selection but is not linked to it: call "
                             f"openmsa.integrations.megatron.link_index_sharing(model) once "
                             f"after building the model")
        source = self.index_source[0]
        ids = None
        options = dict(block_size=self.options["block_size"], softmax_scale=self.softmax_scale,
                       cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                       backend=self.options["backend"])
        if self.warmup:
            options.update(warmup=True, num_index_heads=self.num_query_groups)
        else:
            ids = source.last_indices
            if ids is None:
                raise ValueError(f"MSACoreAttention (layer {self.layer_number}): layer "
                                 f"{source.layer_number}, whose selection it shares, ran no "
                                 f"sparse forward just before (it was in warmup, or has not "
                                 f"run)")
        q, k, v = _openmsa_layout((query, key, value), value.dtype, cu_seqlens)
        out = self._run(sparse_attention, context_parallel_sparse_attention, (q, k, v, ids),
                        options)
        return _megatron_layout(out, query)


def _openmsa_layout(tensors, dtype, cu_seqlens):
    """Megatron's ``[s, b, heads, dim]`` (packed: ``[t, heads, dim]``) as openmsa's
    ``[b, s, heads, dim]`` (packed unchanged), in ``dtype`` (RoPE's fp32 factors may promote
    under autocast)."""
    if cu_seqlens is None:
        tensors = (t.transpose(0, 1) for t in tensors)
    return [t.to(dtype) for t in tensors]


def _megatron_layout(out, query):
    """openmsa's ``out`` in the core-attention slot's layout: ``[s, b, H * D]`` (packed
    ``[t, H * D]``; Megatron adds the batch dimension back)."""
    if query.dim() == 4:  # [s, b, H, D]
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)
    return out.reshape(query.shape[0], -1)


def _check_share_index_every(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"share_index_every: expected an int >= 1, received {value!r}")


def link_index_sharing(model: nn.Module) -> int:
    """Links each MSA layer without an index branch (``share_index_every`` > 1) to the nearest
    earlier layer of ``model`` with one, whose kept blocks it then attends over; returns how
    many it linked. Call once after building the model. A sharing layer whose indexer is not
    in ``model`` (pipeline parallelism splitting a group of layers) is refused by name."""
    layers = sorted((m for m in model.modules() if isinstance(m, MSACoreAttention)),
                    key=lambda m: m.layer_number)
    indexers = {m.layer_number: m for m in layers if m.has_index_branch}
    linked = 0
    for layer in layers:
        if layer.has_index_branch:
            continue
        earlier = [number for number in indexers if number < layer.layer_number]
        if not earlier:
            raise ValueError(f"model: layer {layer.layer_number} shares an earlier layer's "
                             f"selection, but no earlier MSA layer with an index branch is in "
                             f"this model (pipeline stages must start at an indexer layer)")
        source = indexers[max(earlier)]
        if (source.num_query_groups, source.options["block_size"]) != (
                layer.num_query_groups, layer.options["block_size"]):
            raise ValueError(f"model: layer {layer.layer_number} and its indexer layer "
                             f"{source.layer_number} differ in query groups or block size")
        source.hands_on_indices = True
        layer.index_source = [source]
        linked += 1
    return linked


def _packed_offsets(packed_seq_params):
    """(cu_seqlens, max_seqlen) of Megatron's packed-sequence parameters (THD format), or
    (None, None) without them. Self-attention: the query and key offsets must agree; padded
    offsets (padding tokens inside the packing) are refused, as they would count padding
    tokens as queries of the KL."""
    if packed_seq_params is None:
        return None, None
    params = packed_seq_params
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params.qkv_format: expected 'thd', received "
                         f"{params.qkv_format!r}")
    offsets = params.cu_seqlens_q
    if offsets is None:
        raise ValueError("packed_seq_params.cu_seqlens_q: expected the packed sequences' "
                         "offsets, received None")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(params, name, None)
        if other is None or other is offsets:
            continue
        if other.shape != offsets.shape or not torch.equal(other, offsets):
            expected = ("cu_seqlens_q (self-attention)" if name == "cu_seqlens_kv"
                        else "None or cu_seqlens_q (padding inside the packing is not "
                             "supported: padding tokens would count in the KL)")
            raise ValueError(f"packed_seq_params.{name}: expected {expected}, received "
                             f"{other.tolist()} against cu_seqlens_q {offsets.tolist()}")
    max_seqlen = params.max_seqlen_q if isinstance(params.max_seqlen_q, int) else None
    return offsets, max_seqlen


class MSASelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` whose core attention (``MSACoreAttention``) also gets the
    layer's input, detached (the KL trains the index projections only), and its rotary
    frequencies."""

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, *args, **kwargs):
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise ValueError("inference_context: expected None (Megatron inference is not yet "
                             "supported by openmsa.integrations.megatron)")
        rotary = rotary_pos_emb
        if rotary is not None and not isinstance(rotary, tuple):
            rotary = (rotary, rotary)
        self.core_attention.index_inputs = (hidden_states.detach(), rotary)
        return super().forward(hidden_states, attention_mask, key_value_states,
                               inference_context, rotary_pos_emb, *args, **kwargs)


def get_gpt_layer_msa_spec(*, top_k: int = 16, block_size: int = 128, num_local_blocks: int = 1,
                           num_sink_blocks: int = 0, index_precision: str = "input",
                           kl_weight: float = 1.0, backend: str = "auto",
                           qk_layernorm: bool = False, share_index_every: int = 1) -> ModuleSpec:
    """``get_gpt_layer_local_spec(qk_layernorm=...)`` with MSA self-attention; the options are
    ``msa_attention``'s, ``kl_weight`` the KL's weight in the loss. ``share_index_every=N``:
    layers 1, 1 + N, ... have an index branch and the others attend over the kept blocks of
    the nearest earlier one (``link_index_sharing(model)`` after building the model)."""
    _check_share_index_every(share_index_every)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    attention = spec.submodules.self_attention
    attention.module = MSASelfAttention
    attention.submodules.core_attention = ModuleSpec(
        module=MSACoreAttention,
        params=dict(top_k=top_k, block_size=block_size, num_local_blocks=num_local_blocks,
                    num_sink_blocks=num_sink_blocks, index_precision=index_precision,
                    kl_weight=kl_weight, backend=backend, share_index_every=share_index_every))
    return spec


def megatron_msa_kl(model: nn.Module) -> torch.Tensor | None:
    """The mean of the last KL values of ``model``'s MSA layers with an index branch (the
    model's KL, SPEC section 9; detached, for logging), or None before any forward. With
    tensor parallelism it is this rank's index heads' (the model's is the mean over the
    tensor-parallel ranks)."""
    values = [m.last_kl for m in model.modules()
              if isinstance(m, MSACoreAttention) and m.has_index_branch
              and m.last_kl is not None]
    return torch.stack(values).mean() if values else None


__all__ = ["KLIntoBackward", "MSACoreAttention", "MSASelfAttention", "get_gpt_layer_msa_spec",
           "link_index_sharing", "megatron_msa_kl"]
