"""The Hopper (Gluon) forward, compiled for sm_90a without a GPU: it must keep every value in
registers and its products asynchronous, or it loses what it is for. Its results are tested on
the GPU (tests/gpu/test_attention_gpu.py)."""

import os
import re
import subprocess

import pytest
import torch
import triton

from openmsa.ops import hopper


def _ptxas_report(kernel, tmp_path):
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                          capture_output=True, text=True, check=True).stderr


@pytest.mark.parametrize("head_dim,block_size,dtype", [
    (128, 128, "bf16"), (64, 64, "fp16"), (128, 64, "bf16"), (64, 128, "bf16")])
def test_forward_compiles_without_spills_or_serialized_products(head_dim, block_size, dtype,
                                                                 tmp_path):
    kernel = hopper.compile_for_sm90(head_dim, block_size, dtype)
    report = _ptxas_report(kernel, tmp_path)
    assert re.search(r"\b0 bytes spill stores", report), report
    assert "serialized" not in report, report
    assert kernel.metadata.shared <= 227 * 1024

