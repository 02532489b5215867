"""The ``"auto"`` tuning: each call's route from the share of long walks in the previous call's
selection, read on the host without a synchronization.

The adaptive tuning makes random selections 1.2-1.4x faster and coherent ones 1-2% slower (its
hard-row lists, key-outer and combine launches run whether or not a tile walks long); which one
a layer wants depends on how coherently its index branch selects, which changes slowly over
training. Deciding within a call would need the union counts on the host (a synchronization
mid-pass, which measured 1.3-3.5 ms a short eager step: docs/BENCHMARKS.md, "Long-walk routes
only where a tile walks long"), so the decision lags one call.
"""

from __future__ import annotations

import torch

from .configs import ADAPTIVE_TUNING, DEFAULT_TUNING, TUNINGS, Tuning, resolve_tuning
from .custom_ops import is_traced


class AutoTuning:
    """Picks, for each call, the default tuning or ``incoherent`` (default
    ``configs.ADAPTIVE_TUNING``; a name of ``configs.TUNINGS`` or a ``Tuning`` with a walk
    limit).

    After each forward, the share of its (query tile, index head) entries whose union holds
    more blocks than ``incoherent``'s walk limit (those it takes key-outer) is computed on the
    device and copied to pinned host memory asynchronously. A later call reads it once that
    copy has finished (a CUDA event, queried, never waited for) and runs ``incoherent`` while
    the share exceeds ``threshold``, the default otherwise. The route so
    follows the selection one call late or more, and no call synchronizes; the first calls run
    the default. Keep one instance per layer: each layer's selection has its own coherence
    (``MSAAttention(tuning="auto")`` makes one). Eager calls only, as the adaptive tuning:
    torch.compile cannot trace the host-side reading. While a CUDA graph is captured nothing is
    measured, and the graph keeps the route it was captured with.

    ``long_walk_share``: the latest share read (None before the first); ``tuning``: the route
    the next call runs.
    """

    def __init__(self, threshold: float = 0.2, incoherent: Tuning | str = ADAPTIVE_TUNING):
        if (not isinstance(threshold, (int, float)) or isinstance(threshold, bool)
                or not 0.0 <= threshold < 1.0):
            raise ValueError(f"threshold: expected a number in [0, 1), received {threshold!r}")
        if not (isinstance(incoherent, Tuning)
                or isinstance(incoherent, str) and incoherent in TUNINGS):
            raise ValueError(f"incoherent: expected a configs.Tuning or one of "
                             f"{sorted(TUNINGS)}, received {incoherent!r}")
        incoherent = resolve_tuning(incoherent)
        if incoherent.main_walk_limit_per_slot <= 0:
            raise ValueError("incoherent: expected a tuning with a walk limit "
                             "(main_walk_limit_per_slot > 0), which says what walks long")
        self.threshold = float(threshold)
        self.incoherent = incoherent
        self.long_walk_share: float | None = None
        self._tuning = DEFAULT_TUNING
        self._pending = None  # (host counts [2]: long-walk entries, entries; event or None)

    @property
    def tuning(self) -> Tuning:
        """The route the next call runs, after reading a finished measurement."""
        self._read_finished()
        return self._tuning

    def _read_finished(self) -> None:
        if self._pending is None or _capturing():
            return  # querying an event is not allowed while a graph is captured
        counts, event = self._pending
        if event is not None and not event.query():
            return  # still in flight: the previous route holds
        self._pending = None
        long_walks, entries = counts.tolist()
        self.long_walk_share = long_walks / entries if entries else 0.0
        self._tuning = (self.incoherent if self.long_walk_share > self.threshold
                        else DEFAULT_TUNING)

    def observe(self, schedule: torch.Tensor, union_count: torch.Tensor, top_k: int) -> None:
        """Queues the measurement of a selection's query tiles (``QueryTileWork``'s schedule
        ``[E, 2]``, -1 rows padding, and union counts ``[E, Hi]``) against ``incoherent``'s
        walk limit for ``top_k`` slots."""
        if union_count.is_cuda and _capturing():
            return
        limit = max(1, int(self.incoherent.main_walk_limit_per_slot * top_k))
        valid = schedule[:, 0] >= 0
        # Masks, not boolean indexing: that would synchronize.
        counts = torch.stack((((union_count > limit) & valid[:, None]).sum(),
                              valid.sum() * union_count.shape[1]))
        if not counts.is_cuda:
            self._pending = (counts, None)
            return
        host = torch.empty(2, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)

    def __getstate__(self):
        # Copies and pickles start from the latest reading; a measurement in flight (a CUDA
        # event and pinned memory) stays with the original.
        return dict(self.__dict__, _pending=None)

    def __repr__(self) -> str:
        route = "default" if self._tuning == DEFAULT_TUNING else "incoherent"
        return (f"AutoTuning(threshold={self.threshold}, "
                f"long_walk_share={self.long_walk_share}, next={route!r})")


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def route(tuning, inputs=()) -> tuple[AutoTuning | None, Tuning]:
    """``msa_attention``'s ``tuning`` argument as (its AutoTuning or None, the Tuning this call
    runs); an AutoTuning raises where ``inputs`` (the call's tensors) run under a tracer or
    mode (torch.compile, export, fake tensors, a dispatch mode)."""
    if isinstance(tuning, AutoTuning):
        if is_traced(inputs):
            raise ValueError("tuning: an AutoTuning reads its previous call's selection on the "
                             "host, eagerly only; under torch.compile, export, fake or meta "
                             "tensors and dispatch modes leave tuning=None")
        return tuning, tuning.tuning
    if isinstance(tuning, str) and tuning == "auto":
        raise ValueError("tuning: 'auto' keeps a measurement between calls: pass an "
                         "openmsa.AutoTuning() (one per layer), or build the layer as "
                         "MSAAttention(tuning='auto')")
    return None, resolve_tuning(tuning)


def own_tuning(tuning):
    """A layer's ``tuning`` argument, validated: ``"auto"`` becomes an AutoTuning of the
    layer's own (each layer's selection has its own coherence), anything else stays."""
    if isinstance(tuning, str) and tuning == "auto":
        tuning = AutoTuning()
    route(tuning)
    return tuning
