"""Launch configurations and tuning constants of every kernel, in one place.

The values were chosen by measurement on an H200 (docs/EXPERIMENTS.md lists the experiments).
``Tuning`` holds the ones that shape the work lists and the key-outer kernels' steps; the
pipeline takes it as a parameter (tests pass small values to exercise several segments per key
block or several steps per segment).
"""

from __future__ import annotations

from dataclasses import dataclass

# Triton launches (num_warps, num_stages) of the main kernels: the fastest of a sweep of tile
# rows x warps x stages; stage counts are the most that fit in shared memory at D = Di = 128
# without register spills (benchmarks/inspect_kernels.py prints both).
FWD_CONFIG = dict(num_warps=8, num_stages=2)
DQ_CONFIG = dict(num_warps=8, num_stages=2)
DKDV_CONFIG = dict(num_warps=8, num_stages=2)
KL_QUERY_CONFIG = dict(num_warps=8, num_stages=2)
KL_CONFIG = dict(num_warps=8, num_stages=2)
# The KL pass that reads the teachers the dK/dV pass stored (Tuning.kl_teacher "from_dkdv"):
# compiled for sm_90a (benchmarks/inspect_kernels.py), 2 stages serialize its products at any
# pair count, and at 1 stage 32 pairs a step spill nothing (64: 88 bytes). Timed in this
# launch only (benchmarks/records/key-outer-routes.json).
KL_TEACHER_CONFIG = dict(num_warps=8, num_stages=1)
KL_TEACHER_PAIRS = 32
# The index log-sum-exp alone (next to the Hopper forward): a light kernel, memory-bound on the
# index keys, where fewer warps keep more programs resident.
INDEX_ALONE_CONFIG = dict(num_warps=4, num_stages=2)
# Tokens per tile of the index log-sum-exp alone: every block a tile walks costs one load of
# [block, Di] index keys whatever its token count, and neighbouring tokens mostly keep the same
# blocks, so wide tiles pay per block once for many tokens. 64 is the most a tile's members
# mask holds.
INDEX_TILE_TOKENS = 64
# The index log-sum-exp alone, key-outer (given row maxima): pairs per step and the launch;
# tiles whose union holds at most this many blocks per kept slot stay on the query-outer walk.
INDEX_KEY_OUTER_PAIRS = 64
INDEX_KEY_OUTER_CONFIG = dict(num_warps=4, num_stages=2)
INDEX_WALK_LIMIT_PER_SLOT = 3
# The key-outer forward and dQ of the tiles whose walk would be long (attention.key_outer): the
# launch of their per-segment Triton kernels, and whether the Gluon ones replace them.
KEY_OUTER_CONFIG = dict(num_warps=8, num_stages=2)
# Rows a step of the dK/dV kernel that also adds every row's dQ atomically (Tuning.dq_pass
# "dkdv_atomic"): 64-row steps (dK/dV's) spill at 8 warps on sm_90a (docs/KERNELS.md, section 5).
DKDV_ATOMIC_DQ_ROWS = 32
# Rows (query rows x heads) of a combine program and of a dQ-sum program, and their warps:
# H200, 128k, random selections, H64/Hi4 (docs/BENCHMARKS.md): the combine 10.0 ms at 16 rows
# against 15.0 at 64, the dQ sum best at 64 (16.4 ms).
KEY_OUTER_COMBINE_ROWS = 16
KEY_OUTER_SUM_ROWS = 64
KEY_OUTER_COMBINE_WARPS = 4
KEY_OUTER_HOPPER = True  # the key-outer forward and dQ on Gluon kernels where supported
QUERY_ROWS = 128  # MMA rows of a query tile (forward, dQ, KL query side)
REDUCE_KEYS = 32  # keys per program of the segment reductions: enough programs at small sizes

# Selection (tile_rows: MMA rows per program, G index heads x tokens), by index precision.
# imprecise_acc (fp8): products summed by the tensor cores before each partial sum is added in
# full fp32 (Triton's max_num_imprecise_acc; None: the whole 128-long dot, Hopper's default).
SELECT_CONFIG = {"input": dict(tile_rows=128, num_warps=8, num_stages=2),
                 "fp8": dict(tile_rows=128, num_warps=4, num_stages=3, imprecise_acc=32)}
# Selection: two 8-warp programs per SM (65536 registers) need at most 128 registers a thread.
SELECT_MAX_REGISTERS = 128

# Work lists. Up to this many segments one kernel orders them by comparing every pair of keys
# (a few microseconds); beyond, a torch sort does.
RANK_MAX_SEGMENTS = 4096
# Its programs rank RANK_CHUNK keys each against RANK_OTHERS others a step: few dependent steps
# (a step is one read of the keys), tiles of 16k comparisons.
RANK_CHUNK, RANK_OTHERS = 16, 1024
# Up to this many sequences one Triton kernel builds the query-tile schedule; past it, torch
# operations do (the kernel's one program scans every sequence).
SCHEDULE_KERNEL_MAX_SEQUENCES = 256

# Hopper (Gluon) kernels.
KEY_STEP_ROWS = 32  # dK/dV: rows (pairs x heads) per step
KEY_STEP_STAGES = 4  # dK/dV: steps of q and dO rows in shared memory
KL_STAGES = 4  # KL: units of q rows in shared memory (two ahead)
# Registers per thread of the second consumer warpgroup and of the loader (or gather) warp of
# the warp-specialized kernels; the first consumer warpgroup gets 232 too. With these none of
# them spills at a supported shape.
FORWARD_REGISTERS = (232, 40)
DQ_REGISTERS = (232, 40)
KEY_STEP_REGISTERS = (232, 40)
KEY_OUTER_HOPPER_REGISTERS = (232, 48)  # key-outer forward and dQ (Gluon): consumer, gather warps
KEY_OUTER_HOPPER_STAGES = 4  # their steps of gathered rows in shared memory
# Their persistent grid: programs per SM (the forward's 128 KiB and dQ's 192 KiB of shared
# memory leave room for one).
KEY_OUTER_HOPPER_PROGRAMS_PER_SM = 1


KEY_OUTER_DQ_PARTIALS = ("float32", "input")
DQ_PASSES = ("walk", "dkdv_atomic", "hard_atomic")
KL_TEACHERS = ("recompute", "from_dkdv")


@dataclass(frozen=True)
class Tuning:
    """The work lists' and key-outer kernels' sizes.

    segment_pairs: (token, index head) pairs per key-outer program (dK/dV, the KL): bounds a
        program's work when many queries keep the same block.
    short_segment_pairs, short_segments_per_sm, short_segments_min_heads: problems with fewer
        than ``short_segments_per_sm`` segments of ``segment_pairs`` per SM (short contexts:
        few key blocks) and at least ``short_segments_min_heads`` heads per index head cut
        their segments at ``short_segment_pairs``: with so few programs the last wave decides
        the dK/dV and KL kernels' time, and finer segments fill it. Narrower groups (a cheaper
        pair) measured no faster so (docs/BENCHMARKS.md, "Short contexts (4k-16k)").
    long_segment_pairs, long_segments_min_pairs: from ``long_segments_min_pairs`` (token, index
        head, slot) entries on, segments hold ``long_segment_pairs``: each segment's fp32 dK and
        dV partials take ``block x D`` floats, and longer segments bound their memory at 1M
        tokens.
    rows_order_min_segments_per_sm: top-k selections run the key-outer segments by query row
        (their queries then come from L2) once there are this many segments per SM, and the
        longest segments first below.
    kl_pairs: pairs per step of the key-outer KL kernel (its teacher is [block, kl_pairs]).
    main_walk_limit_per_slot: the main attention's forward and dQ take a query tile's rows
        key-outer (``attention.key_outer``) when the tile's union holds more than this many
        blocks per kept slot (x top_k); 0 (the default): every tile walks its union. At 4, with
        the Gluon key-outer kernels, the half-tile walks and bf16 dQ partials, the H200's step
        at 128k ran 1.25x faster on random selections and 0.9-1.1% slower on coherent and mid
        ones (1.4-2.8% at 32k), which have no hard rows and pay for key-outer launches that
        find their windows empty (benchmarks/records/key-outer-deltas.json). The key-outer
        kernels' persistent grid made those launches one short wave each; the combine's and dQ
        sum's launches and the hard-row list still cost coherent selections 0.7-2.3% of a step
        (benchmarks/records/key-outer-persistent.json), so it stays off.
    key_outer_partial_bytes: the most memory the key-outer forward's or dQ's per-slot
        partials take at once (they run over windows of query rows that fit). At 128k on
        random selections 8 GiB made the step 4% faster than 2 GiB (fewer windows).
    key_outer_dq_partials: the key-outer dQ's per-slot partials in the inputs' "input"
        precision (the default: half the memory traffic of writing and summing them, each
        partial rounded once before the fp32 sum; the H200's backward at 128k on random
        selections 7 ms faster, the step 3-5%, dq within bf16's error) or in "float32".
    index_lse_split: the index log-sum-exp beside the Hopper forward split between its walk
        (tiles of at most ``INDEX_WALK_LIMIT_PER_SLOT x top_k`` blocks) and a key-outer pass
        over a list of the other rows' pairs (``attention.index_log_sum_exp_key_outer``), given
        selection's row maxima. Off: its first form (the key-outer pass reading every pair's
        row) was slower than the walk on coherent and mid selections (at 128k 4.5 / 3.8 ms
        against 1.0 / 3.2; random 3.5 against 20.8; kernels alone, index-lse.json); the present
        form (a list of the left rows' pairs alone, per-slot sums) made the step 2-8% faster on
        random selections at 32k and 128k and 0.0-0.9% slower on coherent and mid ones (H200,
        40519a2, dense in the same run: index-lse-split.json).
    dq_pass: where every row's dQ comes from: "walk" (the default: query-outer over each
        tile's union, the hard rows by the key-outer dQ) or "dkdv_atomic" (the dK/dV pass
        adds each step's ``dS K`` atomically into an fp32 sum: no dQ walk and no key-outer dQ,
        a cost that follows the kept pairs on any selection, on the Triton dK/dV kernel, on
        Hopper GPUs too). Atomic sums are not bitwise reproducible, so ``deterministic=True``
        keeps the walk; the fp32 sum takes twice dq's memory (4.3 GB at 128k tokens, 34 GB at
        1M, H64, D = 128). On the H200 (40519a2, dense in the same run) it made the step
        8-19% faster on random selections at 32k and 128k and 5-24% slower on coherent and mid
        ones (benchmarks/records/key-outer-routes.json); with ``main_walk_limit_per_slot=4``
        and ``index_lse_split`` random selections ran 10.69x dense at 128k (coherent and mid,
        with the limit but without the split: 13.26x and 11.81x; the default 16.05x, 12.45x).
        "hard_atomic": the walk for the tiles that walk, and the rows it leaves
        (``main_walk_limit_per_slot``'s hard tiles; with the limit at 0, none) from the dK/dV
        pass's atomic adds instead of the key-outer dQ: only the dK/dV segments holding such
        a row run on the Triton kernel that adds them, the others keep the usual dK/dV kernel
        (Gluon on Hopper GPUs), so the atomic dQ's cost goes where the walk's would be long
        (``key_outer.dkdv_with_hard_atomic_dq``). Not bitwise reproducible where rows are
        hard (``deterministic=True`` takes the key-outer dQ); up to ``hard_atomic_max_bytes``
        of fp32 sum, beyond which the key-outer dQ runs.
    kl_teacher: where the index gradients' teacher (the mean of each pair's GQ heads'
        probabilities) comes from when the forward wants no KL value (``kl_value=False``):
        "from_dkdv" (the default: the forward runs no KL; the backward's dK/dV steps, which
        compute those probabilities anyway, store each pair's teacher [pairs, block] in fp16,
        fp32 for fp32 inputs, and a KL pass without the GQ products reads it; the Triton dK/dV
        kernel, on Hopper GPUs too) or "recompute" (the forward's KL pass rebuilds it, GQ
        products a pair). On the H200 (40519a2, dense in the same run) the step without the
        value ran 1-8% faster (3-7% in most rows) at 8k, 32k and 128k (H64/Hkv4/Hi4) on
        coherent, mid and random selections alike, and as fast at 16k (H16/Hkv2/Hi4)
        (benchmarks/records/key-outer-routes.json, short-routes.json).
        The teachers' atomic adds rule it out with ``deterministic=True``; a frozen main branch
        (the backward runs the KL passes) and cuDNN's warmup take "recompute" too, as does a
        value wanted (it needs the teacher in the forward).
    kl_teacher_max_bytes: "from_dkdv" runs only where the teachers take at most this much
        (4 GiB: 256k tokens at Hi4, top 16, blocks of 128; 16 GiB at 1M), else "recompute".
    hard_atomic_max_bytes: ``dq_pass = "hard_atomic"`` runs only where its fp32 dQ sum
        ([Tq, H, D], allocated whole: how many rows are hard is known on the device alone)
        takes at most this much (8 GiB: 256k tokens at H64, D = 128), else the key-outer dQ.
    """

    segment_pairs: int = 1024
    short_segment_pairs: int = 512
    short_segments_per_sm: int = 8
    short_segments_min_heads: int = 8
    long_segment_pairs: int = 2048
    long_segments_min_pairs: int = 1 << 24
    rows_order_min_segments_per_sm: int = 6
    kl_pairs: int = 64
    main_walk_limit_per_slot: float = 0.0
    key_outer_partial_bytes: int = 2 << 30
    key_outer_dq_partials: str = "input"
    index_lse_split: bool = False
    dq_pass: str = "walk"
    kl_teacher: str = "from_dkdv"
    kl_teacher_max_bytes: int = 4 << 30
    hard_atomic_max_bytes: int = 8 << 30

    def __post_init__(self):
        for name, allowed in (("key_outer_dq_partials", KEY_OUTER_DQ_PARTIALS),
                              ("dq_pass", DQ_PASSES),
                              ("kl_teacher", KL_TEACHERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, "
                                 f"received {getattr(self, name)!r}")
        for name in ("kl_teacher_max_bytes", "hard_atomic_max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected an int of 0 or more, received {value!r}")

    def segment_pairs_for(self, num_queries: int, num_index_heads: int, slots: int,
                          heads_per_index_head: int = 1, multiprocessors: int = 1) -> int:
        """Pairs per key-outer segment for the (token, index head, slot) entries of a problem
        with ``heads_per_index_head`` main heads per index head, on a GPU of
        ``multiprocessors`` SMs (1 on the CPU)."""
        entries = num_queries * num_index_heads * slots
        if entries >= self.long_segments_min_pairs:
            return self.long_segment_pairs
        if (heads_per_index_head >= self.short_segments_min_heads
                and entries < self.short_segments_per_sm * self.segment_pairs * multiprocessors):
            return self.short_segment_pairs
        return self.segment_pairs


DEFAULT_TUNING = Tuning()
# Selections whose neighbours keep different blocks (a freshly converted or early index
# branch): tiles of long walks key-outer, every row's dQ by atomic adds in the dK/dV pass, the
# index log-sum-exp split. On the H200 (40519a2) at 128k random selections ran 10.69x dense
# (the default: 7.00x), mid ones 11.8x (12.45x), coherent ones 13.3x (16.05x)
# (docs/BENCHMARKS.md, "Routes by selection kind"); not bitwise reproducible
# (``deterministic=True`` keeps the dQ walk).
INCOHERENT_TUNING = Tuning(main_walk_limit_per_slot=4.0, dq_pass="dkdv_atomic",
                           index_lse_split=True)
# Each query tile's route by its union: the tiles of long walks key-outer in the forward and
# their rows' dQ from the dK/dV pass's atomic adds (the rest as the default: the walks, the
# Gluon dK/dV), and the index log-sum-exp split. Opt-in: 1.5-5% slower than the default on
# coherent and mid selections, each lever a part (docs/BENCHMARKS.md, "The adaptive tuning").
ADAPTIVE_TUNING = Tuning(main_walk_limit_per_slot=4.0, dq_pass="hard_atomic",
                         index_lse_split=True)
TUNINGS = {"default": DEFAULT_TUNING, "incoherent": INCOHERENT_TUNING,
           "adaptive": ADAPTIVE_TUNING}


def resolve_tuning(tuning) -> Tuning:
    """A ``Tuning`` from ``msa_attention``'s ``tuning`` argument: None (the default), a name
    in ``TUNINGS`` or a ``Tuning``."""
    if tuning is None:
        return DEFAULT_TUNING
    if isinstance(tuning, Tuning):
        return tuning
    if isinstance(tuning, str) and tuning in TUNINGS:
        return TUNINGS[tuning]
    raise ValueError(f"tuning: expected None, a configs.Tuning, an openmsa.AutoTuning or one "
                     f"of {sorted(TUNINGS)}, "
                     f"received {tuning!r}")
