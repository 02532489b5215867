"""The selection kernel in bf16 on the GPU against the fp32 reference. Skipped without a GPU.

The reference runs in fp32 on the same bf16-rounded inputs, so the two differ only in how the
dot products are accumulated. A kept set may then differ from the reference's only where the
swapped blocks' scores are within bf16 rounding of each other (a near-tie).
"""

import json
import os

import pytest
import torch

import openmsa
from openmsa.testing import same_block_sets

CASES = [
    # (S, Hi, Hik, Di, block_size, top_k, options)
    (4096, 4, 1, 128, 128, 16, {}),
    (3000, 4, 2, 64, 64, 8, dict(num_local_blocks=2, num_sink_blocks=1)),
    (2500, 8, 1, 128, 64, 64, {}),
    (6000, 4, 1, 128, 128, 16, dict(num_local_blocks=4, local_block_dilation=3,
                                    num_sink_blocks=1)),
]


def block_scores(index_q, index_k, block_size, scale):
    """fp32 reference block scores [Hi, S, num_blocks] of one sequence ([S, heads, dim])."""
    seqlen = index_q.shape[0]
    index_k = index_k.repeat_interleave(index_q.shape[1] // index_k.shape[1], dim=1)
    z = scale * torch.einsum("ird,jrd->rij", index_q.float(), index_k.float())
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=z.device).tril()
    z = z.masked_fill(~causal, float("-inf"))
    num_blocks = -(-seqlen // block_size)
    z = torch.nn.functional.pad(z, (0, num_blocks * block_size - seqlen), value=float("-inf"))
    return z.view(*z.shape[:-1], num_blocks, block_size).amax(-1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}_Hi{c[1]}_Hik{c[2]}_k{c[5]}")
def test_bf16_selection_matches_fp32_reference_up_to_near_ties(case):
    seqlen, hi, hik, di, block_size, top_k, options = case
    generator = torch.Generator(device="cuda").manual_seed(0)
    index_q = torch.randn(1, seqlen, hi, di, device="cuda", generator=generator).bfloat16()
    index_k = torch.randn(1, seqlen, hik, di, device="cuda", generator=generator).bfloat16()
    kernel = openmsa.select_blocks(index_q, index_k, top_k=top_k, block_size=block_size,
                                   backend="triton", **options)
    reference = openmsa.select_blocks(index_q.float(), index_k.float(), top_k=top_k,
                                      block_size=block_size, backend="reference", **options)
    agree = same_block_sets(kernel, reference)[0]  # [Hi, S]
    rate = agree.float().mean().item()
    record = os.environ.get("OPENMSA_GPU_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"test": "select_agreement", "case": case[:6],
                                "agreement": rate}) + "\n")
    print(f"selection agreement {case[:6]}: {100 * rate:.3f}%")
    scores = block_scores(index_q[0], index_k[0], block_size, di ** -0.5)  # [Hi, S, NB]
    for r, i in (~agree).nonzero().tolist():
        mine = set(kernel[0, r, i].tolist()) - {-1}
        theirs = set(reference[0, r, i].tolist()) - {-1}
        swapped = [scores[r, i, n].item() for n in mine ^ theirs]
        spread = max(swapped) - min(swapped)
        assert spread <= 2 ** -7 * max(abs(s) for s in swapped) + 1e-3, (r, i, mine, theirs)
    assert rate > 0.95
    own = torch.arange(seqlen, device="cuda")[None, None, :, None] // block_size
    assert (kernel == own).any(-1).all()
    dilation = options.get("local_block_dilation", 1)
    for step in range(1, options.get("num_local_blocks", 1)):  # the dilated window's blocks
        wanted = own - step * dilation
        assert ((kernel == wanted).any(-1) | (wanted < 0).squeeze(-1)).all(), step


@pytest.mark.parametrize("seqlens", [(16384,), (5000, 1, 9000, 2384)])
def test_work_lists_from_a_selection_equal_the_torch_built_ones(seqlens):
    """The key-block and query-tile lists the GPU kernels build (one radix sort, wide searches
    over its million pairs) from a real selection: equal to the torch-built lists."""
    from openmsa.ops.worklists import build_block_work, build_query_tile_work
    from openmsa.ops.select import select_blocks_fwd

    generator = torch.Generator(device="cuda").manual_seed(1)
    total = sum(seqlens)
    index_q = torch.randn(total, 4, 128, device="cuda", generator=generator).bfloat16()
    index_k = torch.randn(total, 1, 128, device="cuda", generator=generator).bfloat16()
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32,
                              device="cuda")
    ids = select_blocks_fwd(index_q, index_k, cu_seqlens, top_k=16, block_size=128,
                            index_softmax_scale=128 ** -0.5, num_local_blocks=1,
                            num_sink_blocks=0)  # token-major, as the lists take them
    for order in ("pairs", "rows"):
        lists = [build_block_work(ids, cu_seqlens, 128, 2048, segment_order=order,
                                  use_triton=use).packed() for use in (True, False)]
        assert torch.equal(lists[0], lists[1]), order
    tiles = [build_query_tile_work(ids, cu_seqlens, 32, use_triton=use) for use in (True, False)]
    for name in ("schedule", "union", "union_members", "union_count"):
        assert torch.equal(getattr(tiles[0], name), getattr(tiles[1], name)), name


def test_blocks_scoring_far_below_zero_are_kept():
    """Every index score negative, most below -2 (index queries opposite to the keys): the
    kept blocks are the reference's, not only the forced ones."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    index_q = -(torch.randn(1, 4096, 4, 128, device="cuda", generator=generator).abs() + 1)
    index_k = torch.randn(1, 4096, 1, 128, device="cuda", generator=generator).abs() + 1
    index_q, index_k = index_q.bfloat16(), index_k.bfloat16()
    options = dict(top_k=8, block_size=128)
    ids = openmsa.select_blocks(index_q, index_k, **options)
    reference = openmsa.select_blocks(index_q.float(), index_k.float(), backend="reference",
                                      **options)
    visible = torch.arange(4096, device="cuda") // 128 + 1  # blocks each query sees
    assert torch.equal((reference >= 0).sum(-1), visible.clamp(max=8).expand(1, 4, -1))
    assert same_block_sets(ids, reference).float().mean() >= 0.99
