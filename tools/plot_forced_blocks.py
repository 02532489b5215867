"""Developer tooling: the picture of SPEC section 3 step 3 in docs/KERNELS.md, the blocks every
query block keeps whatever the index scores say (own block, local window, sinks), drawn from the
reference's own rule (``naive.select_blocks_from_scores``) for a contiguous and a dilated window.

    python tools/plot_forced_blocks.py docs/images/forced-blocks.png
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from openmsa.ops.naive import select_blocks_from_scores  # noqa: E402

NUM_BLOCKS = 16
PATTERNS = [  # (title, num_local_blocks, local_block_dilation, num_sink_blocks)
    ("num_local_blocks=4 (contiguous)", 4, 1, 1),
    ("num_local_blocks=4, local_block_dilation=3", 4, 3, 1),
]


def forced_grid(num_local: int, dilation: int, sinks: int) -> torch.Tensor:
    """[query block, key block]: 1 where the key block is forced for that query block. Every
    score is -inf, so the reference keeps nothing but the forced blocks."""
    query_blocks = torch.arange(NUM_BLOCKS)
    scores = torch.full((NUM_BLOCKS, NUM_BLOCKS), float("-inf"))
    ids = select_blocks_from_scores(scores, query_blocks, num_local + sinks, num_local, sinks,
                                    dilation)
    grid = torch.zeros(NUM_BLOCKS, NUM_BLOCKS)
    for row, kept in enumerate(ids.tolist()):
        for block in kept:
            if block >= 0:
                grid[row, block] = 2 if block == row else (3 if block < sinks else 1)
    return grid


def main(path: str) -> None:
    figure, axes = plt.subplots(1, len(PATTERNS), figsize=(10, 5))
    colors = matplotlib.colors.ListedColormap(["#f4f4f4", "#4c9be8", "#1f3f73", "#e8a33c"])
    for axis, (title, num_local, dilation, sinks) in zip(axes, PATTERNS):
        axis.imshow(forced_grid(num_local, dilation, sinks), cmap=colors, vmin=0, vmax=3)
        axis.set_title(f"{title}, num_sink_blocks={sinks}", fontsize=9)
        axis.set_xlabel("key block")
        axis.set_ylabel("query block blk(i)")
        axis.set_xticks(range(0, NUM_BLOCKS, 2))
        axis.set_yticks(range(0, NUM_BLOCKS, 2))
    handles = [matplotlib.patches.Patch(color=c, label=label) for c, label in
               zip(colors.colors[1:], ["local window", "own block", "sink"])]
    figure.legend(handles=handles, loc="lower center", ncol=3)
    figure.suptitle("Forced blocks: kept whatever the index scores (they count toward top_k)")
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/images/forced-blocks.png")
