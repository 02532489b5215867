"""Convert Hugging Face ``transformers`` Llama and Qwen3 causal LMs to MSA.

``convert_to_msa(model)`` replaces each attention module with ``HFMSAAttention``, which keeps the
module's q/k/v/o projections (and Qwen3's per-head QK-norms) and adds an index branch: one index
query head per KV group and one shared index key head, of the model's head dim. The index
projections start as averages of the main ones (index query r = mean of the query projections
of KV group r's heads; index key = mean of the key projections), so the index scores start as
the group's average main score: the index branch selects roughly what the main attention would
look at from step one, and the KL refines it. With ``use_cache=True`` (``generate()``) the layers
cache the index keys beside k and v and run ``msa_decode``; no padding masks (pack sequences
instead, or generate one sequence or equal-length batches). After each forward,
``msa_kl(model)`` is the mean KL over the layers with an index branch; add ``kl_weight * msa_kl(model)`` to the loss. ``share_index_every=N``: layers
0, N, 2N, ... get an index branch, the others attend over the blocks of the nearest one before
them (SPEC section 9) and have no index projections.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..layers.msa_attention import rotate_half
from ..ops.auto_tuning import own_tuning
from ..ops.decode import msa_decode
from ..ops.msa import msa_attention, sparse_attention
from ..ops.validate import check_index_precision, check_local_block_dilation

SUPPORTED = ("LlamaAttention", "Qwen3Attention")


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        raise ImportError("openmsa.integrations.transformers needs the transformers package: "
                          "pip install transformers") from error


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotary embedding on ``[B, S, heads, D]`` with ``cos``/``sin`` ``[B, S, D]``."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


class HFMSAAttention(nn.Module):
    """A Llama / Qwen3 attention module running MSA (see the module docstring)."""

    is_msa_layer = True  # openmsa.set_msa_warmup / MSAWarmupSchedule switch it

    def __init__(self, original: nn.Module, *, top_k: int, block_size: int,
                 num_local_blocks: int, num_sink_blocks: int, backend: str,
                 index_precision: str = "input", share_index_from: "HFMSAAttention | None" = None,
                 local_block_dilation: int = 1, share_index_kl: bool = False, tuning=None):
        super().__init__()
        tuning = own_tuning(tuning)
        config = original.config
        self.config, self.layer_idx = config, original.layer_idx
        self.head_dim = original.head_dim
        self.scaling = original.scaling
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj, self.k_proj = original.q_proj, original.k_proj
        self.v_proj, self.o_proj = original.v_proj, original.o_proj
        identity = nn.Identity()
        self.q_norm = getattr(original, "q_norm", identity)
        self.k_norm = getattr(original, "k_norm", identity)
        self.options = dict(top_k=top_k, block_size=block_size,
                            num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks,
                            local_block_dilation=local_block_dilation, backend=backend,
                            index_precision=index_precision, tuning=tuning)
        self.warmup = False
        self.last_kl = None
        # An empty dict here asks the next forward to record its last query token's selection
        # (``record_selection``); the forward fills it once.
        self.selection_record = None
        # The kept ids of the latest forward, for the layers sharing this one's selection; the
        # layer whose selection this one reads (a tuple: not a registered submodule).
        self.last_indices = None
        self._hands_on_indices = False
        self._index_source = ()
        # With share_index_kl the sharing layers also need the index inputs of their source.
        self.share_index_kl = share_index_kl
        self.last_index_inputs = None
        self._hands_on_index_inputs = False
        if share_index_from is not None:
            if share_index_from._index_source:
                share_index_from = share_index_from._index_source[0]
            mine = (self.num_heads, self.num_kv_heads, block_size)
            theirs = (share_index_from.num_heads, share_index_from.num_kv_heads,
                      share_index_from.options["block_size"])
            if mine != theirs:
                raise ValueError(f"share_index_every: layer {self.layer_idx} has (H, Hkv, "
                                 f"block_size) = {mine}, the layer {share_index_from.layer_idx} "
                                 f"whose selection it would share has {theirs}")
            self._index_source = (share_index_from,)
            share_index_from._hands_on_indices = True
            share_index_from._hands_on_index_inputs |= share_index_kl
            return
        self.index_q_norm = copy.deepcopy(self.q_norm)
        self.index_k_norm = copy.deepcopy(self.k_norm)
        hidden = self.q_proj.in_features
        self.index_q_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.index_k_proj = nn.Linear(hidden, self.head_dim, bias=False)
        with torch.no_grad():
            group = self.num_heads // self.num_kv_heads
            q_weight = self.q_proj.weight.view(self.num_kv_heads, group, self.head_dim, hidden)
            self.index_q_proj.weight.copy_(q_weight.mean(dim=1).reshape(-1, hidden))
            k_weight = self.k_proj.weight.view(self.num_kv_heads, self.head_dim, hidden)
            self.index_k_proj.weight.copy_(k_weight.mean(dim=0))
        self.index_q_proj.to(self.q_proj.weight)
        self.index_k_proj.to(self.q_proj.weight)

    @property
    def has_index_branch(self) -> bool:
        """Whether the layer selects its own blocks (False: it shares an earlier layer's)."""
        return len(self._index_source) == 0

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        batch, seqlen, _ = hidden_states.shape
        cos, sin = position_embeddings

        def heads(layer, x, count, norm):
            # Under autocast a projection gives the autocast dtype, but RoPE's (and a norm's)
            # fp32 factors promote it: every branch enters the kernels in the projection's.
            projected = layer(x).view(batch, seqlen, count, self.head_dim)
            return _rope(norm(projected), cos, sin).to(projected.dtype)

        q = heads(self.q_proj, hidden_states, self.num_heads, self.q_norm)
        k = heads(self.k_proj, hidden_states, self.num_kv_heads, self.k_norm)
        v = self.v_proj(hidden_states).view(batch, seqlen, self.num_kv_heads, self.head_dim)
        index_q = index_k = None
        if self.has_index_branch:
            detached = hidden_states.detach()  # the KL trains the index projections only
            index_q = heads(self.index_q_proj, detached, self.num_kv_heads, self.index_q_norm)
            index_k = heads(self.index_k_proj, detached, 1, self.index_k_norm)
        if cache is not None:
            out = self._cached_attention(q, k, v, index_q, index_k, cache, kwargs)
        elif not self.has_index_branch:
            out = self._shared_attention(q, k, v)
        else:
            hands_on = self._hands_on_indices and not self.warmup
            out, kl, *indices = msa_attention(q, k, v, index_q, index_k,
                                              softmax_scale=self.scaling, warmup=self.warmup,
                                              return_indices=hands_on, **self.options)
            self.last_kl = kl
            if self._hands_on_indices:
                self.last_indices = indices[0] if indices else None
            if self._hands_on_index_inputs:
                self.last_index_inputs = (index_q, index_k)
        return self.o_proj(out.reshape(batch, seqlen, -1)), None

    def _record(self, q, keys, ids):
        """Fills an empty ``selection_record`` with the last query token's kept ids
        ``[B, Hi, k]``, its queries ``[B, H, D]`` (after RoPE), every key ``[B, L, Hkv, D]``
        and the softmax scale (what ``openmsa.eval`` reads for block and mass recall)."""
        if self.selection_record == {} and ids is not None:
            self.selection_record.update(ids=ids[:, :, -1].detach(), query=q[:, -1].detach(),
                                         keys=keys.detach(), scale=self.scaling,
                                         block_size=self.options["block_size"])

    def _cached_attention(self, q, k, v, index_q, index_k, cache, kwargs):
        """Inference with the model's cache (``use_cache=True``, ``generate()``): k and v go
        through ``cache.update`` as in the original module, the index keys beside them (a dict
        ``openmsa_index_keys`` on the cache object, by layer), then ``msa_decode`` of the new
        tokens against every cached one. No KL."""
        k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx,
                                    kwargs=kwargs)
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, L, Hkv, D]
        index_k_all = None
        if index_k is not None:
            stored = cache.__dict__.setdefault("openmsa_index_keys", {})
            previous = stored.get(self.layer_idx)
            index_k_all = index_k if previous is None else torch.cat((previous, index_k), dim=1)
            stored[self.layer_idx] = index_k_all
        lengths = torch.full((q.shape[0],), k_all.shape[1], dtype=torch.int32, device=q.device)
        options = dict(block_size=self.options["block_size"], softmax_scale=self.scaling,
                       backend=self.options["backend"])
        self.last_kl = None
        if self.warmup:
            return msa_decode(q, k_all, v_all, None, None, lengths, warmup=True, **options)
        if not self.has_index_branch:
            ids = self._source_indices()
            self._record(q, k_all, ids)
            return msa_decode(q, k_all, v_all, None, None, lengths, block_indices=ids,
                              **options)
        out, ids = msa_decode(q, k_all, v_all, index_q, index_k_all, lengths,
                              top_k=self.options["top_k"],
                              num_local_blocks=self.options["num_local_blocks"],
                              local_block_dilation=self.options["local_block_dilation"],
                              num_sink_blocks=self.options["num_sink_blocks"],
                              index_precision=self.options["index_precision"],
                              return_indices=True, **options)
        if self._hands_on_indices:
            self.last_indices = ids
        self._record(q, k_all, ids)
        return out

    def _source_indices(self):
        """The kept ids of the layer whose selection this one shares, from its forward just
        before."""
        source = self._index_source[0]
        if source.last_indices is None:
            raise ValueError(f"block_indices: layer {self.layer_idx} shares the selection of "
                             f"layer {source.layer_idx}, which has none (it ran in warmup, or "
                             f"did not run before this layer)")
        return source.last_indices

    def _shared_attention(self, q, k, v):
        """A layer without an index branch: the main attention over its source layer's latest
        kept blocks (dense in warmup); with ``share_index_kl`` also the KL of the source's index
        inputs against this layer's attention (into ``last_kl``)."""
        options = dict(block_size=self.options["block_size"], softmax_scale=self.scaling,
                       backend=self.options["backend"])
        ids = None if self.warmup else self._source_indices()
        if self.share_index_kl:
            index_q, index_k = self._index_source[0].last_index_inputs
            out, self.last_kl = msa_attention(q, k, v, index_q, index_k, warmup=self.warmup,
                                              block_indices=ids, **dict(self.options,
                                                                        **options))
            return out
        if self.warmup:
            return sparse_attention(q, k, v, warmup=True, num_index_heads=self.num_kv_heads,
                                    **options)
        return sparse_attention(q, k, v, ids, tuning=self.options["tuning"], **options)


def convert_to_msa(model: nn.Module, *, top_k: int = 16, block_size: int = 128,
                   num_local_blocks: int = 1, num_sink_blocks: int = 0,
                   backend: str = "auto", index_precision: str = "input",
                   share_index_every: int = 1, local_block_dilation: int = 1,
                   share_index_kl: bool = False, tuning=None) -> int:
    """Replaces every Llama / Qwen3 attention module of ``model`` in place; returns how many.
    The options are ``msa_attention``'s (``index_precision="fp8"``: selection on fp8 index
    scores). ``share_index_every=N``: the attention modules 0, N, 2N, ... (in the model's
    order) get an index branch, the others share the selection of the nearest one before them
    (default 1: every layer selects). ``share_index_kl=True``: the sharing layers' attention
    also teaches the index branch they read (their KL, over their kept tokens, reaches its
    index projections and counts in ``msa_kl``). ``tuning``: the kernels' routes, as
    ``msa_attention``'s; ``"auto"`` gives every layer an ``AutoTuning`` of its own (a freshly
    converted index branch may select incoherently: the adaptive tuning's case)."""
    _require_transformers()
    check_index_precision(index_precision)
    check_local_block_dilation(local_block_dilation)
    if (isinstance(share_index_every, bool) or not isinstance(share_index_every, int)
            or share_index_every < 1):
        raise ValueError(f"share_index_every: expected an int >= 1, received "
                         f"{share_index_every!r}")
    if not isinstance(share_index_kl, bool):
        raise ValueError(f"share_index_kl: expected a bool, received {share_index_kl!r}")
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ in SUPPORTED]
    if not targets:
        raise ValueError(f"model: expected attention modules of type {SUPPORTED}, found none")
    converted = []
    for position, (name, module) in enumerate(targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        source = (None if position % share_index_every == 0
                  else converted[position - position % share_index_every])
        converted.append(HFMSAAttention(
            module, top_k=top_k, block_size=block_size, num_local_blocks=num_local_blocks,
            num_sink_blocks=num_sink_blocks, backend=backend, index_precision=index_precision,
            share_index_from=source, local_block_dilation=local_block_dilation,
            share_index_kl=share_index_kl and source is not None, tuning=tuning))
        setattr(parent, child, converted[-1])
    return len(targets)


def record_selection(model: nn.Module) -> list[dict]:
    """Asks every converted layer of ``model`` to record, during its next forward with the
    cache (``use_cache=True``: the prefill of ``generate()``), the last query token's kept
    block ids, queries, keys and softmax scale; returns the layers' records in order (filled
    by that forward; layers in warmup record nothing)."""
    layers = [module for module in model.modules() if isinstance(module, HFMSAAttention)]
    for layer in layers:
        layer.selection_record = {}
    return [layer.selection_record for layer in layers]


def msa_kl(model: nn.Module) -> torch.Tensor:
    """Mean KL over the converted layers with an index branch (and, with ``share_index_kl``,
    the layers sharing one), from the last forward."""
    kls = [module.last_kl for module in model.modules()
           if isinstance(module, HFMSAAttention) and module.last_kl is not None]
    if not kls:
        raise ValueError("model: expected converted MSA layers that ran a forward, found none")
    return torch.stack(kls).mean()
