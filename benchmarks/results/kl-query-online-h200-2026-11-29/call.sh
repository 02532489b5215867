#!/usr/bin/env bash
# One-off A/B call: old tree (c226dcc) vs working tree, plus the training preset variants.
set -u
O=/tmp/o; mkdir -p $O
export PYTHONUNBUFFERED=1 OPENMSA_GPU_RECORD=$O/gpu_tests.jsonl
R=$PWD
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } > $O/env.txt 2>&1
PYTHONPATH=$R timeout 100 python3 -m pytest -q -rA tests/gpu/test_attention_gpu.py > $O/pytest_attention_gpu.log 2>&1
tail -3 $O/pytest_attention_gpu.log
PYTHONPATH=$R/ab_old timeout 140 python3 ab_old/benchmarks/bench_msa.py --kinds coherent --out $O/old > $O/bench_msa_old.log 2>&1
PYTHONPATH=$R timeout 140 python3 benchmarks/bench_msa.py --kinds coherent --out $O/new > $O/bench_msa_new.log 2>&1
tail -4 $O/bench_msa_old.log; tail -4 $O/bench_msa_new.log
PYTHONPATH=$R timeout 150 python3 -c "
from dataclasses import replace
from openmsa.train import run as r
r.PRESETS['gpu-kv1'] = replace(r.PRESETS['gpu'], num_kv_heads=1)
r.run('gpu-kv1', '$O/train_kv1')" > $O/train_kv1.log 2>&1
tail -3 $O/train_kv1.log
PYTHONPATH=$R timeout 150 python3 -m openmsa.cli train --preset gpu --out $O/train_kv2 > $O/train_kv2.log 2>&1
tail -3 $O/train_kv2.log
tar czf $OUT/call1.tgz -C $O .
