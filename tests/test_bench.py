"""FLOP accounting and the ``openmsa bench`` command line (CPU)."""

import warnings

import pytest
import torch

from openmsa import cli
from openmsa.bench import flops


def test_dense_and_index_flops_count_the_causal_triangle():
    assert flops.causal_pairs(4) == 10
    assert flops.dense_attention_flops(4, num_heads=2, head_dim=8) == 4 * 2 * 8 * 10
    assert flops.index_scoring_flops(4, num_index_heads=3, index_head_dim=8) == 2 * 3 * 8 * 10
    # The GUIDE's table: 32k, H64, D128 dense causal forward = 17.6 TFLOP.
    assert abs(flops.dense_attention_flops(32768, 64, 128) / 1e12 - 17.6) < 0.05
    assert abs(flops.index_scoring_flops(131072, 4, 128) / 1e12 - 8.8) < 0.05


def test_kept_triples_counts_own_block_keys_up_to_the_query():
    # block 4, 6 tokens: query 5 keeps blocks {1 (own: keys 4, 5), 0 (4 keys)} -> 6 keys.
    ids = torch.tensor([[[0, -1]], [[0, -1]], [[0, -1]], [[0, -1]], [[1, 0]], [[1, 0]]])
    assert flops.kept_triples(ids, block_size=4, heads_per_index_head=1) == 1 + 2 + 3 + 4 + 5 + 6
    assert flops.kept_triples(ids, block_size=4, heads_per_index_head=16) == 16 * 21
    assert flops.max_kept_triples(6, num_heads=1, top_k=2, block_size=4) == 21


def test_max_kept_triples_matches_a_brute_force_count():
    seqlen, top_k, block = 700, 3, 64
    brute = sum(min(i + 1, i % block + 1 + (top_k - 1) * block) for i in range(seqlen))
    assert flops.max_kept_triples(seqlen, 1, top_k, block) == brute
    # The GUIDE's table counts 16 full blocks per query: 8.8 TFLOP at 128k, H64, D128; the own
    # block is on average half visible, so the exact count is ~3% lower.
    triples = flops.max_kept_triples(131072, 64, 16, 128)
    assert 8.4 < flops.main_attention_flops(triples, 128) / 1e12 < 8.8


def test_bench_arguments_are_parsed_and_validated(capsys):
    assert cli.main(["bench", "--dry-run", "--preset", "h16", "--seqlens", "4k,16k",
                     "--top-k", "8", "--block-size", "64"]) == 0
    plan = capsys.readouterr().out
    assert "H16/Hkv2/Hi4" in plan and "4096" in plan and "16384" in plan and "top_k=8" in plan
    assert cli.main(["bench", "--dry-run", "--heads", "32,8,8", "--seqlens", "1m"]) == 0
    assert "H32/Hkv8/Hi8" in capsys.readouterr().out
    assert cli.main(["bench", "--dry-run", "--selection", "mid", "--index-precision",
                     "fp8"]) == 0
    assert "selections=mid index_precision=fp8 tuning=default" in capsys.readouterr().out
    assert cli.main(["bench", "--dry-run", "--tuning", "incoherent"]) == 0
    assert "tuning=incoherent" in capsys.readouterr().out
    assert cli.main(["bench", "--dry-run"]) == 0  # every kind unless asked otherwise
    assert "selections=coherent,mid,random" in capsys.readouterr().out
    assert cli.main(["bench", "--dry-run", "--selections", "random,coherent"]) == 0
    assert "selections=random,coherent" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dry-run", "--selection", "mid,sparse"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--index-precision", "fp4"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dry-run", "--tuning", "fast"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--seqlens", "4q"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--heads", "64,5,4"])


@pytest.mark.parametrize("flag,value,says", [
    ("--seqlens", "-4k", "positive length"), ("--seqlens", "0", "positive length"),
    ("--seqlens", ",", "comma-separated lengths"), ("--top-k", "-3", r"in \[1, 64\]"),
    ("--top-k", "65", r"in \[1, 64\]"), ("--block-size", "100", "invalid choice"),
    ("--head-dim", "7", "invalid choice"), ("--heads", "0,1,1", "positive head counts"),
    ("--baseline-max-seqlen", "-1", "positive length"),
])
def test_bench_refuses_values_it_cannot_run(flag, value, says, capsys):
    """Even a dry run: the plan would print negative FLOPs or shapes no kernel takes."""
    with pytest.raises(SystemExit) as raised:
        cli.main(["bench", "--dry-run", f"{flag}={value}"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}" in error and __import__("re").search(says, error), error


def test_bench_help_explains_every_option_and_its_default(capsys):
    import argparse

    from openmsa.bench.run import add_arguments

    options = argparse.ArgumentParser()
    add_arguments(options)
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for action in options._actions[1:]:  # [0] is --help
        assert action.help, action.dest
        if action.default not in (None, False):
            assert f"(default: {action.default})" in text, action.dest


def test_bench_without_a_gpu_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_baseline_mask_keeps_each_tiles_blocks_causally():
    """The FlexAttention baseline's mask equals explicit per-tile block sets (forward, CPU)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import openmsa
    from openmsa.bench.run import flex_block_mask

    torch.manual_seed(0)
    seqlen, heads, kv_heads, index_heads, dim = 512, 4, 2, 2, 64
    q, k, v = (torch.randn(1, h, seqlen, dim) for h in (heads, kv_heads, kv_heads))
    ids = openmsa.select_blocks(torch.randn(1, seqlen, index_heads, dim),
                                torch.randn(1, seqlen, 1, dim), top_k=2, block_size=128)
    out = flex.flex_attention(q, k, v, block_mask=flex_block_mask(ids, heads, seqlen),
                              enable_gqa=True)
    allowed = torch.zeros(heads, seqlen, seqlen, dtype=torch.bool)
    for h in range(heads):
        for i in range(seqlen):
            tile_last = min(i // 128 * 128 + 127, seqlen - 1)
            for block in ids[0, h // (heads // index_heads), tile_last].tolist():
                if block >= 0:
                    allowed[h, i, block * 128:(block + 1) * 128] = True
    allowed &= torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    scores = q[0] @ k[0].repeat_interleave(2, 0).transpose(-1, -2) * dim ** -0.5
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v[0].repeat_interleave(2, 0)
    torch.testing.assert_close(out[0], expected, rtol=1e-4, atol=1e-4)


def test_plots_are_written_when_no_baseline_ran(tmp_path):
    """Past --baseline-max-seqlen there is no dense time to compare with."""
    pytest.importorskip("matplotlib")
    from openmsa.bench.run import plot

    rows = [dict(status="ok", seqlen=seqlen, msa_fwd_bwd_ms=ms, selection=kind,
                 dense_status="skipped: S > --baseline-max-seqlen")
            for seqlen, ms in ((524288, 880.0), (1048576, 2290.0))
            for kind in ("coherent", "random")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns of a legend with nothing to label
        plot(rows, str(tmp_path))
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_selection_statistics_count_neighbours_overlap_and_unions():
    from openmsa.bench.selection import selection_statistics

    ids = torch.tensor([[0, 1, -1], [0, 1, 2], [3, 4, 5], [3, 4, 5]] * 4,
                       dtype=torch.int32)[:, None, :]  # [16 tokens, 1 head, 3 slots]
    stats = selection_statistics(ids)
    # Pairs: {0,1}-{0,1,2} 2/3, {0,1,2}-{3,4,5} 0, {3,4,5}-{3,4,5} 1, {3,4,5}-{0,1} 0, ...
    assert abs(stats["jaccard"] - (4 * (2 / 3 + 0 + 1) + 3 * 0) / 15) < 1e-6
    assert stats["union_8"] == 6  # each group of 8 tokens keeps blocks 0..5


def test_selection_kinds_order_by_neighbours_overlap():
    """coherent > mid > random in neighbours' Jaccard, on the reference selection."""
    import openmsa
    from openmsa.bench.selection import index_inputs, selection_statistics

    jaccard = {}
    for kind in ("coherent", "mid", "random"):
        generator = torch.Generator().manual_seed(0)
        index_q, index_k = index_inputs(kind, 4096, 2, 64, generator, device="cpu")
        ids = openmsa.select_blocks(index_q[None].float(), index_k[None].float(), top_k=8,
                                    block_size=64, backend="reference")
        jaccard[kind] = selection_statistics(ids[0].permute(1, 0, 2))["jaccard"]
    # At 4k tokens and top 8 of 64 blocks: about 0.97, 0.70 and 0.33.
    assert jaccard["coherent"] > jaccard["mid"] + 0.15 > jaccard["random"] + 0.3, jaccard
    with pytest.raises(ValueError, match="kind"):
        index_inputs("sorted", 64, 1, 64, torch.Generator(), device="cpu")


def test_bench_decode_dry_run_prints_each_steps_bandwidth_floor(capsys):
    """--decode plans context x batch steps with the bytes each must read: at 128k, H64/Hkv4/
    Hi4, top 16 of 128, MSA reads about 7x fewer bytes than dense decoding."""
    from openmsa.bench.decode import decode_bytes

    assert cli.main(["bench", "--decode", "--dry-run", "--seqlens", "128k",
                     "--batches", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "--decode" in out and "131072     8" in out
    sizes = decode_bytes(8, 131072, (64, 4, 4), 128, 16, 128)
    assert sizes["dense_bytes"] == 8 * 131072 * 4 * 128 * 2 * 2
    assert 6.5 < sizes["dense_bytes"] / sizes["msa_bytes"] < 7.5
    with pytest.raises(SystemExit):
        cli.main(["bench", "--decode", "--batches", "0"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--decode", "--batches", "a"])


def test_bench_times_every_selection_kind_and_dense_once_per_length(monkeypatch, tmp_path,
                                                                     capsys):
    """run(): each length on each kind of --selection, in order; the dense figures a length's
    first kind measures are the ones its other kinds report (the same dict)."""
    from openmsa.bench import run as bench_run

    calls = []

    def fake_measure(row, args, selection, dense):
        if not dense:
            dense.update(dense_fwd_bwd_ms=float(row["seqlen"]))
        calls.append((row["seqlen"], selection, id(dense)))
        return dict(row, selection=selection, status="ok", msa_fwd_bwd_ms=1.0,
                    jaccard=0.5, union_8=30.0, **dense)

    monkeypatch.setattr(bench_run, "measure", fake_measure)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    assert cli.main(["bench", "--seqlens", "4k,8k", "--selection", "random,mid", "--out",
                     str(tmp_path)]) == 0
    assert [(s, kind) for s, kind, _ in calls] == [(4096, "random"), (4096, "mid"),
                                                    (8192, "random"), (8192, "mid")]
    assert calls[0][2] == calls[1][2] != calls[2][2] == calls[3][2]
    table = capsys.readouterr().out
    assert "selection" in table and "Jaccard" in table and "union8" in table
    assert table.count(" random ") >= 2 and table.count(" mid ") >= 2


def test_fla_baseline_passes_msa_ids_in_fla_layout_and_refuses_other_heads(monkeypatch):
    """The fla baseline gives ParallelNSAFunction ids [1, S, Hkv, k] (int64, -1 unused) read
    as fla documents them; a stand-in for fla that computes that reading with openmsa's
    reference must agree with sparse_attention. Head layouts fla cannot run are skipped."""
    import sys
    import types

    import openmsa
    from openmsa.bench.run import fla_baseline

    seen = {}

    class StandIn:
        @staticmethod
        def apply(q, k, v, ids, top_k, block_size, scale, cu_seqlens):
            seen.update(shape=tuple(ids.shape), dtype=ids.dtype, top_k=top_k, scale=scale)
            return openmsa.sparse_attention(q, k, v, ids[0].permute(1, 0, 2)[None].int(),
                                            block_size=block_size, softmax_scale=scale,
                                            backend="reference")

    module = types.ModuleType("fla.ops.nsa.parallel")
    module.ParallelNSAFunction = StandIn
    for name in ("fla", "fla.ops", "fla.ops.nsa"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.nsa.parallel", module)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 200, heads, 64, generator=generator).requires_grad_()
               for heads in (16, 1, 1))  # as the bench's inputs
    index_q, index_k = (torch.randn(1, 200, 1, 64, generator=generator) for _ in range(2))
    ids = openmsa.select_blocks(index_q, index_k, top_k=2, block_size=64, backend="reference")
    dout = torch.randn_like(q)
    result = fla_baseline(q, k, v, dout, ids, 64, lambda fn: (fn(), 1.0)[1], None)
    assert seen == dict(shape=(1, 200, 1, 2), dtype=torch.int64, top_k=2, scale=64 ** -0.5)
    assert result["fla_vs_msa_out_rel_rms"] < 1e-6 and result["fla_fwd_bwd_ms"] == 1.0
    q8 = torch.randn(1, 200, 8, 64)
    assert "H / Hkv a power of 2 >= 16" in fla_baseline(q8, k, v, dout, ids, 64, None,
                                                         None)["fla_status"]
    monkeypatch.setitem(sys.modules, "fla.ops.nsa.parallel", None)
    assert "fla-core is not installed" in fla_baseline(q, k, v, dout, ids, 64, None,
                                                       None)["fla_status"]


def test_bench_step_options_carry_the_tuning():
    """The timed MSA step runs ``--tuning``'s routes; selection alone takes no tuning."""
    import argparse

    from openmsa.bench.options import msa_options, step_options
    from openmsa.bench.run import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tuning", "incoherent"])
    assert step_options(args) == dict(msa_options(args), tuning="incoherent")
    assert "tuning" not in msa_options(args)
    assert parser.parse_args([]).tuning == "default"
    # "auto": a fresh AutoTuning for each timed case (each selection kind measures its own).
    from openmsa import AutoTuning

    auto = parser.parse_args(["--tuning", "auto"])
    first, second = step_options(auto)["tuning"], step_options(auto)["tuning"]
    assert isinstance(first, AutoTuning) and first is not second


@pytest.mark.parametrize("tuning", ["adaptive", "incoherent", "auto"])
def test_bench_correctness_check_runs_with_each_tuning(tuning):
    """``measure``'s check before timing: ``compare_with_reference`` on the timed step's
    options, ``--tuning`` among them (the references take a tuning and run no routes)."""
    import argparse

    from openmsa import msa_attention
    from openmsa.bench.options import step_options
    from openmsa.bench.run import add_arguments
    from openmsa.testing import TOLERANCE, MSACase, compare_with_reference

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tuning", tuning, "--top-k", "2", "--block-size", "64"])
    case = MSACase("check", batch=1, seqlen=200, num_heads=4, num_kv_heads=1,
                   num_index_heads=1, head_dim=64, index_head_dim=64,
                   options=step_options(args))
    comparison = compare_with_reference(msa_attention, case, torch.float32, "cpu")
    assert comparison.passed(TOLERANCE[torch.float32]), comparison.errors
