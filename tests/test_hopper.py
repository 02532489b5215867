"""The Hopper (Gluon) kernels, compiled for sm_90a without a GPU: their tensor-core products must
stay asynchronous (ptxas serializes them when registers run short or the accumulators are read
too early) and their values in registers, or they lose what they are for. Their results are
tested on the GPU (tests/gpu/test_attention_gpu.py)."""

import os
import re
import subprocess

import pytest
import triton

from openmsa.ops import hopper

SHARED_MEMORY_LIMIT = 227 * 1024  # per block on the H100/H200
# dQ holds dS of block u - 1 (in flight), the scores and dO V^T of block u and the dq
# accumulator: ptxas spills 48 bytes of its 255 registers at D = 128, outside the products.
SPILL_BYTES = {"forward": 0, "dq": 64}


def _ptxas_report(kernel, tmp_path):
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                          capture_output=True, text=True, check=True).stderr


@pytest.mark.parametrize("kernel", ["forward", "dq"])
@pytest.mark.parametrize("head_dim,block_size,dtype", [
    (128, 128, "bf16"), (64, 64, "fp16"), (128, 64, "bf16"), (64, 128, "bf16")])
def test_kernels_compile_with_asynchronous_products(kernel, head_dim, block_size, dtype,
                                                     tmp_path):
    compiled = hopper.compile_for_sm90(head_dim, block_size, dtype, kernel=kernel)
    report = _ptxas_report(compiled, tmp_path)
    assert "serialized" not in report, report
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert spills and int(spills.group(1)) <= SPILL_BYTES[kernel], report
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT
