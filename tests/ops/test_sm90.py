"""The Hopper (Gluon) kernels, compiled for sm_90a without a GPU: their tensor-core products must
stay asynchronous (ptxas serializes them when registers run short or the accumulators are read
too early) and their values in registers, or they lose what they are for. Their results are
tested on the GPU (tests/gpu/test_attention_gpu.py). The compiler is developer tooling
(tools/sm90_compile.py), run from the repository's root."""

import json
import os
import re
import subprocess
import sys

from pathlib import Path

import pytest

from openmsa.ops import sm90

ROOT = Path(__file__).parents[2]  # tools/ lives beside the package

SHARED_MEMORY_LIMIT = 227 * 1024  # per block on the H100/H200
# The KL's step end (student, d index_q and their addresses next to the d index_k accumulator)
# spills up to 20 bytes at D = 128 (0 at D = 64); its bound stays at the 64 it once needed.
# The persistent key-outer forward spills up to 64 bytes at D = 128 (4 or 16 heads a pair):
# scalars of its segment loop (pairs, block, step counts), read from the L1 cache.
SPILL_BYTES = {"forward": 0, "dq": 0, "dq-walk-limit": 0, "dkdv": 0, "dkdv-skip": 0, "kl": 64,
               "key-outer-forward": 64, "key-outer-dq": 0, "key-outer-dq-16bit": 0}
# Compiled in a process of its own: with TRITON_INTERPRET=1 (the README's test command) Triton
# swaps its language functions for interpreted ones, which the Gluon compiler then refuses.
COMPILE = """
import json, sys
from tools.sm90_compile import compile_for_sm90, ptxas_report
kernel = compile_for_sm90(*json.loads(sys.argv[1]), heads_per_token=int(sys.argv[2]),
                          kernel=sys.argv[3])
print(json.dumps([ptxas_report(kernel.asm["ptx"])["text"], kernel.metadata.shared]))
"""


def _compile(kernel, head_dim, block_size, dtype, heads_per_token):
    """(ptxas's report, shared memory bytes) of the kernel compiled for sm_90a."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    printed = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps([head_dim, block_size, dtype]),
         str(heads_per_token), kernel],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    report, shared = json.loads(printed)
    return report, int(shared)


@pytest.mark.parametrize("kernel", ["forward", "dq", "dq-walk-limit", "dkdv", "dkdv-skip", "kl",
                                    "key-outer-forward", "key-outer-dq", "key-outer-dq-16bit"])
@pytest.mark.parametrize("head_dim,block_size,dtype,heads_per_token", [
    (128, 128, "bf16", 16), (128, 128, "bf16", 4), (64, 64, "fp16", 4), (128, 64, "bf16", 3),
    (64, 128, "bf16", 16)])
def test_kernels_compile_with_asynchronous_products(kernel, head_dim, block_size, dtype,
                                                     heads_per_token):
    report, shared = _compile(kernel, head_dim, block_size, dtype, heads_per_token)
    assert "serialized" not in report, report
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert spills and int(spills.group(1)) <= SPILL_BYTES[kernel], report
    assert shared <= SHARED_MEMORY_LIMIT


def test_gather_and_tma_readiness_follow_strides_and_alignment():
    """The Hopper kernels take only tensors their copies can read: rows gathered in 16-byte
    pieces (``_rows_ready``), or heads read as one 2D TMA box (``_tma_ready``)."""
    import torch

    t = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    assert sm90._rows_ready(t) and sm90._tma_ready(t)
    assert not sm90._rows_ready(t[..., 1:])  # base 2 bytes off alignment
    assert not sm90._rows_ready(t.transpose(1, 2).contiguous().transpose(1, 2))  # D strided
    assert sm90._rows_ready(t[:, ::2]) and not sm90._tma_ready(t[:, ::2])  # heads apart
    assert not sm90._tma_ready(t.transpose(0, 1))  # token rows not a 2D box's rows


SELECT_COMPILE = """
import sys
from tools.sm90_compile import compile_select_for_sm90
print(compile_select_for_sm90(sys.argv[1]).metadata.shared)
"""


@pytest.mark.parametrize("index_precision", ["input", "fp8"])
def test_selection_kernels_compile_for_sm90(index_precision):
    """The selection kernel in both precisions (and the fp8 quantization kernel) compile for
    sm_90a at their launch configuration (configs.SELECT_CONFIG) and fit in shared memory: the
    interpreter once passed a version the GPU compiler refused."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    printed = subprocess.run([sys.executable, "-c", SELECT_COMPILE, index_precision],
                             capture_output=True, text=True, cwd=ROOT, env=env)
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert 0 < int(printed.stdout.split()[-1]) <= SHARED_MEMORY_LIMIT


DECODE_COMPILE = """
import json, sys
from tools.sm90_compile import compile_decode_for_sm90, ptxas_report
kernels = compile_decode_for_sm90(*json.loads(sys.argv[1]))
print(json.dumps([ptxas_report(kernel.asm["ptx"])["spill_bytes"] for kernel in kernels]))
print(json.dumps([kernel.asm["ptx"].count("griddepcontrol.wait") for kernel in kernels]))
"""


@pytest.mark.parametrize("shape", [(1, 4, 16, False), (16, 4, 16, False), (16, 16, 4, False),
                                   (1, 4, 16, True)],
                         ids=["one_token", "16_tokens", "16_tokens_G16", "one_token_pdl"])
def test_decode_kernels_compile_for_sm90_without_spills(shape):
    """The decode kernels (new tokens, index heads per key head, main heads per index head,
    programmatic dependent launch) compile for sm_90a with nothing spilled: the interpreter
    checks their results, not what the GPU compiler accepts."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    printed = subprocess.run([sys.executable, "-c", DECODE_COMPILE, json.dumps(list(shape))],
                             capture_output=True, text=True, cwd=ROOT, env=env)
    assert printed.returncode == 0, printed.stderr[-3000:]
    lines = printed.stdout.split("\n")
    assert json.loads(lines[-3]) == [0] * 5
    # With PDL each kernel waits for the one before it ahead of its first read, once.
    assert json.loads(lines[-2]) == [1 if shape[3] else 0] * 5


KEY_OUTER_COMPILE = """
import json, sys
from tools.sm90_compile import compile_key_outer_for_sm90, ptxas_report
from openmsa.ops import configs
launch = getattr(configs, sys.argv[2])
kernel = compile_key_outer_for_sm90(sys.argv[1], launch["num_stages"], launch["num_warps"])
report = ptxas_report(kernel.asm["ptx"])
print(json.dumps([report["spill_bytes"], report["serialized"], kernel.metadata.shared]))
"""


@pytest.mark.parametrize("kernel,launch,spill_bytes", [
    ("dkdv-atomic-dq", "DKDV_CONFIG", 0), ("dkdv-hard-atomic-dq", "DKDV_CONFIG", 0),
    ("dkdv+teacher", "DKDV_CONFIG", 60), ("dkdv-hard-atomic-dq+teacher", "DKDV_CONFIG", 0),
    ("dkdv-atomic-dq+teacher", "DKDV_CONFIG", 0), ("kl-teacher", "KL_TEACHER_CONFIG", 0)])
def test_key_outer_lever_kernels_compile_for_sm90(kernel, launch, spill_bytes):
    """The Triton key-outer kernels behind the levers, at their launch and step sizes:
    dK/dV with every row's dQ added atomically (``Tuning.dq_pass = "dkdv_atomic"``) or the
    hard rows' alone on the segments holding one (``"hard_atomic"``), storing
    the KL teachers (``kl_teacher = "from_dkdv"``; "+teacher"), and the KL pass reading them,
    compile for sm_90a with their products asynchronous (a dQ product shaped ``[rows, D]``, a
    teacher made by an MMA, the teacher pass at 2 stages: each serialized them) and at most
    ``spill_bytes`` spilled (the plain dK/dV's own 2-stage launch spills 52)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    printed = subprocess.run([sys.executable, "-c", KEY_OUTER_COMPILE, kernel, launch],
                             capture_output=True, text=True, cwd=ROOT, env=env)
    assert printed.returncode == 0, printed.stderr[-3000:]
    spills, serialized, shared = json.loads(printed.stdout.splitlines()[-1])
    assert not serialized and spills <= spill_bytes and shared <= SHARED_MEMORY_LIMIT, \
        printed.stdout


def test_inspect_kernels_compiles_the_triton_kernels_with_their_default_constants():
    """benchmarks/inspect_kernels.py builds each kernel's signature itself: a constexpr with a
    default (the forward's walk limits) once went in as a pointer and stopped the script."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    printed = subprocess.run([sys.executable, "benchmarks/inspect_kernels.py", "--stages", "1",
                              "--kernels", "forward", "dQ"],
                             capture_output=True, text=True, cwd=ROOT,
                             env=dict(env, PYTHONPATH=str(ROOT)))
    assert printed.returncode == 0, printed.stderr[-3000:]
    rows = [line.split() for line in printed.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["forward", "dQ"], printed.stdout
    assert all(row[-2] == "yes" and int(row[-3]) == 0 for row in rows), printed.stdout
