"""``AutoTuning``: the route of each call from the share of long walks its previous calls'
selections measured (the measurement's arithmetic, its reading without waiting, and
``msa_attention`` / ``sparse_attention`` / ``MSAAttention`` running the route it picks)."""

import copy
import dataclasses

import pytest
import torch

import openmsa
from openmsa.ops import attention as attention_module
from openmsa.ops import msa as msa_module
from openmsa.ops.auto_tuning import AutoTuning
from openmsa.ops.configs import ADAPTIVE_TUNING, DEFAULT_TUNING, INCOHERENT_TUNING, Tuning
from openmsa.testing import random_inputs, run_with_grads

from attention_cases import count_calls

# Schedules of three tiles (the last one padding) over two index heads, top_k = 2: the
# adaptive limit is 4 x 2 = 8 blocks.
SCHEDULE = torch.tensor([[0, 0], [0, 1], [-1, -1]], dtype=torch.int32)


def _read(auto, union_count, top_k=2):
    auto.observe(SCHEDULE, torch.tensor(union_count, dtype=torch.int32), top_k)
    return auto.tuning


def test_share_counts_entries_past_the_limit_and_skips_padding():
    auto = AutoTuning(threshold=0.3)
    # 2 of the 4 real entries hold more than 8 blocks (9, 16); 8 itself does not pass; the
    # padding tile's 99s are not counted.
    assert _read(auto, [[9, 8], [16, 3], [99, 99]]) is ADAPTIVE_TUNING
    assert auto.long_walk_share == 0.5
    assert _read(auto, [[9, 8], [7, 3], [99, 99]]) is DEFAULT_TUNING  # 0.25 <= 0.3
    assert auto.long_walk_share == 0.25
    # The limit follows top_k (4 x 4 = 16) and the incoherent tuning's walk limit (2 x 2).
    assert _read(auto, [[9, 8], [16, 3], [0, 0]], top_k=4) is DEFAULT_TUNING
    halved = AutoTuning(threshold=0.3, incoherent=dataclasses.replace(
        ADAPTIVE_TUNING, main_walk_limit_per_slot=2.0))
    assert _read(halved, [[5, 4], [5, 3], [0, 0]]) is halved.incoherent
    assert halved.long_walk_share == 0.5


def test_threshold_and_incoherent_tuning_are_honoured():
    """A share exactly at the threshold stays on the default; the tuning past it is the one
    given (a name or a Tuning)."""
    auto = AutoTuning(threshold=0.5, incoherent="incoherent")
    assert auto.tuning is DEFAULT_TUNING and auto.long_walk_share is None  # nothing read yet
    assert _read(auto, [[9, 8], [16, 3], [0, 0]]) is DEFAULT_TUNING
    assert _read(auto, [[9, 9], [16, 3], [0, 0]]) is INCOHERENT_TUNING
    assert _read(AutoTuning(threshold=0.0), [[9, 0], [0, 0], [0, 0]]) is ADAPTIVE_TUNING
    assert _read(AutoTuning(threshold=0.0), [[8, 0], [0, 0], [0, 0]]) is DEFAULT_TUNING


class _Event:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


def test_a_measurement_in_flight_is_not_waited_for():
    """While the copy's event has not completed, the previous route holds; once it has, the
    reading switches the route, once."""
    auto = AutoTuning()
    event = _Event(False)
    auto._pending = (torch.tensor([3, 4]), event)
    assert auto.tuning is DEFAULT_TUNING and auto.long_walk_share is None
    event.done = True
    assert auto.tuning is ADAPTIVE_TUNING and auto.long_walk_share == 0.75
    assert auto._pending is None
    # Copies start from the latest reading, without the measurement in flight.
    auto._pending = (torch.tensor([0, 4]), _Event(False))
    copied = copy.deepcopy(auto)
    assert copied._pending is None and copied.tuning == ADAPTIVE_TUNING


def test_bad_arguments_name_themselves():
    for value in (-0.1, 1.0, True, "0.2"):
        with pytest.raises(ValueError, match="^threshold: expected a number in"):
            AutoTuning(threshold=value)
    with pytest.raises(ValueError, match="^incoherent: expected a configs.Tuning or one of"):
        AutoTuning(incoherent="fast")
    with pytest.raises(ValueError, match="^incoherent: expected a tuning with a walk limit"):
        AutoTuning(incoherent=DEFAULT_TUNING)


# The interpreter's kernels from here on.
needs_interpreter = pytest.mark.skipif(
    not msa_module.INTERPRETING, reason="needs TRITON_INTERPRET=1 (the README's test command)")

# One 640-token sequence, 16 heads per index head (8-token tiles), top 2 of 10 blocks of 64:
# random index scores spread a tile's 16 slots over more than 1 block per slot.
CASE = dict(top_k=2, block_size=64)
# Past one block per kept slot a tile walks long: its rows' dQ by the dK/dV pass's atomics.
LONG_WALKS = Tuning(main_walk_limit_per_slot=1.0, dq_pass="hard_atomic")


def _inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((1, 640, 16, 64), (1, 640, 1, 64), (1, 640, 1, 64), (1, 640, 1, 64),
              (1, 640, 1, 64))
    return [torch.randn(*shape, generator=generator).requires_grad_() for shape in shapes]


def _step(inputs, tuning):
    out, kl = openmsa.msa_attention(*inputs, backend="triton", tuning=tuning, **CASE)
    grads = torch.autograd.grad(out.square().sum() + kl, inputs)
    return [out.detach(), kl.detach(), *grads]


@needs_interpreter
def test_msa_attention_runs_the_route_its_previous_call_measured(monkeypatch):
    """The first call runs the default (no measurement yet) and measures long walks; the next
    runs the incoherent tuning and gives that tuning's results bitwise. A threshold above the
    measured share keeps the default."""
    routes = count_calls(monkeypatch, attention_module, {
        "dkdv_with_hard_atomic_dq": "hard_atomic", "_walk_dq": "walk"})
    inputs = _inputs(0)
    auto = AutoTuning(threshold=0.05, incoherent=LONG_WALKS)
    first = _step(inputs, auto)
    assert routes == ["walk"], routes
    share = auto.long_walk_share
    assert share is None  # read at the next call, not at the end of this one
    second = _step(inputs, auto)
    assert 0.05 < auto.long_walk_share <= 1.0, auto.long_walk_share
    assert "hard_atomic" in routes[1:], routes
    for got, expected in zip(first, _step(inputs, DEFAULT_TUNING)):
        assert torch.equal(got, expected)
    for got, expected in zip(second, _step(inputs, LONG_WALKS)):
        assert torch.equal(got, expected)
    measured = auto.long_walk_share
    stays = AutoTuning(threshold=min(0.99, measured + 0.01), incoherent=LONG_WALKS)
    _step(inputs, stays)
    del routes[:]
    _step(inputs, stays)
    assert routes == ["walk"] and stays.long_walk_share == measured, routes


@needs_interpreter
def test_auto_is_eager_and_per_layer():
    """The string "auto" needs a layer (one AutoTuning each); under a dispatch mode (as under
    torch.compile) an AutoTuning raises."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = _inputs(1)
    with pytest.raises(ValueError, match="^tuning: 'auto' keeps a measurement"):
        openmsa.msa_attention(*inputs, backend="triton", tuning="auto", **CASE)
    with FlopCounterMode(display=False):
        with pytest.raises(ValueError, match="^tuning: an AutoTuning reads"):
            openmsa.msa_attention(*inputs, backend="triton", tuning=AutoTuning(), **CASE)
    first, second = (openmsa.MSAAttention(128, 4, 2, head_dim=64, top_k=2, block_size=64,
                                          tuning="auto") for _ in range(2))
    assert isinstance(first.options["tuning"], AutoTuning)
    assert first.options["tuning"] is not second.options["tuning"]


@needs_interpreter
def test_sharing_call_runs_the_selecting_calls_route(monkeypatch):
    """``sparse_attention`` on handed-on ids runs the tuning that selected them, whatever its
    own AutoTuning last read, and so reuses their work lists (no check of the ids)."""
    inputs = _inputs(2)
    auto = AutoTuning(threshold=0.05, incoherent=LONG_WALKS)
    _step(inputs, auto)  # measured: the next call runs LONG_WALKS
    out, kl, ids = openmsa.msa_attention(*inputs, backend="triton", tuning=auto,
                                         return_indices=True, **CASE)
    assert msa_module.HandedOnSelection.tuning_of(ids) is LONG_WALKS
    checks = []
    original = msa_module.validate_sparse_args

    def recorded(*args, check_index_values, **options):
        checks.append(check_index_values)
        return original(*args, check_index_values=check_index_values, **options)

    monkeypatch.setattr(msa_module, "validate_sparse_args", recorded)
    fresh = AutoTuning(threshold=0.05, incoherent=LONG_WALKS)  # reads the default
    q, k, v = (t.detach() for t in inputs[:3])
    shared = openmsa.sparse_attention(q, k, v, ids, block_size=64, backend="triton",
                                      tuning=fresh)
    assert checks == [False]  # handed on: its lists reused
    expected = openmsa.sparse_attention(q, k, v, ids.clone(), block_size=64, backend="triton",
                                        tuning=LONG_WALKS)
    assert checks == [False, True]
    assert torch.equal(shared, expected)
    assert torch.equal(shared, out.detach())
