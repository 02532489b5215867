"""Pretraining a small GPT with MSA attention in Megatron-core, on synthetic data.

    pip install megatron-core
    torchrun --nproc_per_node 1 examples/megatron_pretrain.py [--steps 300] [--seqlen 4096]

Megatron's GPTModel on its local layer spec with openmsa's self-attention
(``openmsa.integrations.megatron.get_gpt_layer_msa_spec``): Megatron's projections and RoPE,
``msa_attention`` in the core-attention slot, the KL carried into the backward with the
attention output (no change to the loss). The data are random "key value" lists followed by a
repeat of the keys, whose values the model must recall: the next-token loss on the repeated
part falls only when attention finds each key's first occurrence, so MSA's selection has to
learn where to look. Dense warmup for the first ``--warmup-steps``, then sparse.

GPU (bf16 autocast, the Triton kernels); the script runs one process. The layer spec also runs
under Megatron's tensor and context parallelism (docs/PRODUCTION.md, Megatron-core): a
multi-process loop would add Megatron's data sharding, vocab-parallel loss and gradient
reduction around the same model.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist


def build_model(seqlen: int, layers: int = 2, hidden: int = 256, heads: int = 4, groups: int = 2,
                top_k: int = 4, block_size: int = 128, vocab: int | None = None,
                backend: str = "auto", share_index_every: int = 1):
    """A GPTModel with MSA self-attention, head dim 64; ``vocab`` (default: as many tokens as
    ``recall_batch`` needs at ``seqlen``); ``share_index_every=N``: every N-th layer selects
    for the N - 1 after it (linked here)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from openmsa.integrations.megatron import get_gpt_layer_msa_spec, link_index_sharing

    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=64,
                               attention_dropout=0.0, hidden_dropout=0.0,
                               use_cpu_initialization=True)
    spec = get_gpt_layer_msa_spec(top_k=top_k, block_size=block_size, backend=backend,
                                  share_index_every=share_index_every)
    model = GPTModel(config, spec, vocab_size=vocab or seqlen // 2, max_sequence_length=seqlen,
                     position_embedding_type="rope", rotary_base=1_000_000)
    link_index_sharing(model)
    return model


def recall_batch(batch: int, seqlen: int, vocab: int, generator, device):
    """Tokens ``[batch, seqlen]``: pairs (key, value) for the first half, then the same keys
    again each followed by its value; and the mask of the positions whose next token is a
    recalled value (the loss's)."""
    pairs = seqlen // 4
    if pairs > vocab // 2:
        raise ValueError(f"vocab: expected at least {2 * pairs} tokens (distinct keys for "
                         f"{pairs} pairs, in its lower half), received {vocab}")
    keys = torch.stack([torch.randperm(vocab // 2, generator=generator)[:pairs]
                        for _ in range(batch)])
    values = torch.randint(vocab // 2, vocab, (batch, pairs), generator=generator)
    first = torch.stack([keys, values], -1).flatten(1)
    tokens = torch.cat([first, first], 1)
    scored = torch.zeros_like(tokens, dtype=torch.bool)
    scored[:, first.shape[1]::2] = True  # each repeated key: its next token is the value
    return tokens.to(device), scored.to(device)


def train(model, steps: int, warmup_steps: int, batch: int, seqlen: int, device, lr=1e-3,
          log_every: int = 0, seed: int = 0) -> list[float]:
    """Adam on every parameter; returns the recall loss of every step."""
    from openmsa import MSAWarmupSchedule
    from openmsa.integrations.megatron import megatron_msa_kl

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = MSAWarmupSchedule(warmup_steps)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.vocab_size
    positions = torch.arange(seqlen, device=device).expand(batch, -1)
    # Megatron's local attention reads this mask; MSA is causal by itself.
    mask = torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool, device=device), 1)[None, None]
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=torch.device(device).type == "cuda")
    losses = []
    for step in range(steps):
        warmup = schedule.apply(model, step)
        tokens, scored = recall_batch(batch, seqlen, vocab, generator, device)
        with autocast:
            logits = model(tokens, positions, mask)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1][scored[:, :-1]].float(),
                                                 tokens[:, 1:][scored[:, :-1]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the KL's gradient rides the attention outputs' backward
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            kl = megatron_msa_kl(model)
            print(f"step {step:4d} {'warmup' if warmup else 'sparse'}: recall loss "
                  f"{loss.item():.3f}, kl {0.0 if kl is None else kl.item():.4f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--share-index-every", type=int, default=1,
                        help="every N-th layer selects blocks for the N - 1 after it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("examples/megatron_pretrain.py: expected a CUDA GPU (Megatron-core "
                         "assumes one)")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if "RANK" in os.environ:
        dist.init_process_group("nccl")
    else:  # plain `python examples/megatron_pretrain.py`: a group of one
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0,
                                world_size=1)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    model = build_model(args.seqlen, layers=args.layers, top_k=args.top_k,
                        share_index_every=args.share_index_every).cuda()
    losses = train(model, args.steps, args.warmup_steps, args.batch, args.seqlen, "cuda",
                   log_every=max(1, args.steps // 10))
    print(f"recall loss: first 10 steps {sum(losses[:10]) / 10:.3f}, last 10 steps "
          f"{sum(losses[-10:]) / 10:.3f} (chance: ln({model.vocab_size // 2}) = "
          f"{torch.log(torch.tensor(model.vocab_size / 2)).item():.3f})")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
