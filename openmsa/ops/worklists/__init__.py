"""Work lists of the sparse attention kernels, built on the device from the kept block ids:
query tiles and their block unions (query-outer kernels), key-block -> queries lists in
segments (key-outer kernels)."""

from .key_blocks import (BlockWork, block_work_sizes, build_block_work,
                         build_causal_block_work)
from .query_tiles import (MAX_TILE_TOKENS, QueryTileWork, build_causal_query_tile_work,
                          build_query_tile_work, query_tile_entries, query_tile_schedule)

__all__ = ["BlockWork", "block_work_sizes", "build_block_work", "build_causal_block_work",
           "MAX_TILE_TOKENS", "QueryTileWork", "build_causal_query_tile_work",
           "build_query_tile_work", "query_tile_entries", "query_tile_schedule"]
