#!/usr/bin/env bash
# The GPU run: GPU tests, bf16 check against the reference, benchmarks. Prints short tables last.
#   bash benchmarks/run_gpu.sh OUTDIR [PARTS]   PARTS: all (default) or a comma-separated list
#   of select, attention, kl, msa (the benchmark scripts), kl-exp-split (bench_kl.py --exp-split:
#   the Gluon KL kernel's exponentials split or not, alone and in the step, next to dense; its
#   lengths up to OPENMSA_MAX_SEQLEN, default 131072), fp8 (bench_fp8_index.py), sharing
#   (bench_sharing.py), decode (openmsa bench --decode), train, sharing-train (the GPU preset with
#   OPENMSA_TRAIN_LAYERS layers, default 2, every layer selecting against layer 0 selecting for
#   all, without and with --share-index-kl, side by side, for each seed of OPENMSA_TRAIN_SEEDS,
#   default 0), decode-kernels
#   (bench_decode_kernels.py: the decode kernels' launches and the step's stages), key-outer
#   (bench_key_outer.py: the main attention's tiles of long walks key-outer, by walk limit;
#   OPENMSA_KEY_OUTER_ARGS adds arguments, e.g. "--limits 0,4 --dq-routes walk,dkdv_atomic"), bench
#   (the user-facing commands `openmsa train --preset gpu` and `openmsa bench`, every selection
#   kind; fla's NSA baseline where fla-core is importable), cli (= train,bench), short
#   (profile_host.py and bench_segments.py at 4k-16k: host against GPU time, segment sizes),
#   megatron (tests/gpu/test_megatron_gpu.py and bench_megatron.py; megatron-core must be
#   importable: carry its wheel, e.g. `pip download --no-deps --only-binary=:all:
#   --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1`,
#   and install it there with `pip install --no-index --no-deps --target`), study
#   (benchmarks/quality_study.py: OPENMSA_STUDY_STAGES, default train,adapt,eval,report, of the
#   long-context quality study into OPENMSA_STUDY_DIR, default runs/study, which a warm
#   machine keeps between calls; OPENMSA_STUDY_ARGS adds arguments, e.g. --variants fp8,share2;
#   with OPENMSA_STUDY_BACKGROUND=1 it runs in a session of its own, which outlives the call),
#   study-wait (waits up to OPENMSA_STUDY_WAIT seconds, default 540, for that background study;
#   packs everything of it but the weights into OUTDIR/study.tgz, its progress while it runs),
#   compare (`openmsa bench` from each folder of OPENMSA_COMPARE_TREES, then from this tree, one
#   after the other in one call: before and after a change, each with its own dense; a folder
#   holds another commit's package, made here with tools/tree_copy.sh and carried to the
#   machine; OPENMSA_COMPARE_ARGS, default "--seqlens 32k,128k --no-flex --no-fla"),
#   tunings (benchmarks/profile_tunings.py: the step and its kernels under each named tuning
#   against the first, every selection kind; OPENMSA_TUNINGS_ARGS adds arguments, e.g.
#   "--seqlens 32768 --tunings default,adaptive"),
#   learn-probe (benchmarks/probe_lm_learning.py --preset ruler-gpu: the study's dense model on
#   its curriculum through the 1024-token phase, accuracy of all six tasks at 1024 tokens and
#   of the first phase's at its length: does it learn? OPENMSA_PROBE_ARGS adds arguments, e.g.
#   "--lr 5e-4 --first-steps 4000 --steps 4000")
# OPENMSA_GPU_TESTS names the test files to run (default: all of tests/gpu), to split the suite
# over calls of a time-limited machine; "none" runs no test and no check (a study's calls).
# Where only a few result files can be copied back, write to a scratch folder and tar it:
#   bash benchmarks/run_gpu.sh /tmp/run cli; tar czf "$OUT/run.tgz" -C /tmp/run .
# Runs from the repository root with the machine's own torch and triton (nothing is installed).
set -u
out=${1:?usage: run_gpu.sh OUTDIR [all|PART,PART...]}
parts=",${2:-all},"
wants() {
  [ "$parts" = ",all," ] && [[ ! "$1" =~ ^(kl-exp-split|train|bench|fp8|sharing|decode|sharing-train|decode-kernels|key-outer|short|megatron|study|study-wait|learn-probe|compare|tunings)$ ]] \
    && return 0
  [[ "$parts" == *",$1,"* ]] || { [[ "$parts" == *",cli,"* ]] && [[ "$1" =~ ^(train|bench)$ ]]; }
}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OPENMSA_GPU_RECORD="$out/gpu_tests.jsonl"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  # A copied working tree may carry a stale .git: the caller can name the commit instead.
  echo "commit ${OPENMSA_COMMIT:-$(git log -1 --format=%H 2>/dev/null)}"
} 2>&1 | tee "$out/env.txt"
if [ "${OPENMSA_GPU_TESTS:-}" != none ]; then
  python3 -m pytest -q -rA ${OPENMSA_GPU_TESTS:-tests/gpu} 2>&1 | tee "$out/pytest_gpu.log" \
    | grep -E "passed|failed|error" | tail -30
  python3 -m openmsa.cli check 2>&1 | tee "$out/check.txt"
fi
if wants select; then
  python3 benchmarks/bench_select.py --out "$out" 2>&1 | tee "$out/bench_select.log" | tail -8
fi
if wants attention; then
  python3 benchmarks/bench_attention.py --out "$out" 2>&1 | tee "$out/bench_attention.log" | tail -12
fi
if wants kl; then
  python3 benchmarks/bench_kl.py --out "$out" 2>&1 | tee "$out/bench_kl.log" | tail -8
fi
if wants kl-exp-split; then
  python3 benchmarks/bench_kl.py --out "$out" --exp-split --max-seqlen "${OPENMSA_MAX_SEQLEN:-131072}" \
    2>&1 | tee "$out/bench_kl_exp_split.log" | tail -20
fi
if wants msa; then
  python3 benchmarks/bench_msa.py --out "$out" 2>&1 | tee "$out/bench_msa.log" | tail -9
fi
if wants fp8; then
  python3 benchmarks/bench_fp8_index.py --out "$out" 2>&1 | tee "$out/bench_fp8_index.log" | tail -14
fi
if wants sharing; then
  python3 benchmarks/bench_sharing.py --out "$out" 2>&1 | tee "$out/bench_sharing.log" | tail -14
fi
if wants decode; then
  python3 -m openmsa.cli bench --decode --seqlens 32k,128k,512k --out "$out/bench_decode" 2>&1 \
    | tee "$out/openmsa_bench_decode.log" | tail -29
  python3 -m openmsa.cli bench --decode --seqlens 128k --index-precision fp8 \
    --selections coherent --prefill-seqlens "" --out "$out/bench_decode_fp8" 2>&1 \
    | tee "$out/openmsa_bench_decode_fp8.log" | tail -4
fi
if wants key-outer; then
  python3 benchmarks/bench_key_outer.py --out "$out" ${OPENMSA_KEY_OUTER_ARGS:-} 2>&1 \
    | tee "$out/bench_key_outer.log" | tail -30
fi
if wants tunings; then
  python3 benchmarks/profile_tunings.py --out "$out" ${OPENMSA_TUNINGS_ARGS:-} 2>&1 \
    | tee "$out/profile_tunings.log" | tail -40
fi
if wants train; then
  python3 -m openmsa.cli train --preset gpu --out "$out/train" 2>&1 | tee "$out/openmsa_train.log" | tail -3
fi
if wants decode-kernels; then
  python3 benchmarks/bench_decode_kernels.py --out "$out" 2>&1 \
    | tee "$out/bench_decode_kernels.log" | tail -14
fi
if wants sharing-train; then
  layers=${OPENMSA_TRAIN_LAYERS:-2}
  pids=()
  for seed in ${OPENMSA_TRAIN_SEEDS:-0}; do
    # small kernels: the runs share the GPU; "kl": the sharing layers teach the index too
    for variant in 1 "$layers" "$layers kl"; do
      set -- $variant
      name="train_layers${layers}_share$1${2:+_$2}_seed$seed"
      python3 -m openmsa.cli train --preset gpu --layers "$layers" --share-index-every "$1" \
        ${2:+--share-index-kl} --seed "$seed" --out "$out/$name" > "$out/$name.log" 2>&1 &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
  tail -n 2 "$out"/train_layers"${layers}"_share*.log
fi
if wants short; then
  python3 benchmarks/profile_host.py --out "$out/host" --cases h64:4096,h64:8192,h16:8192,h16:16384 \
    --selections coherent,mid,random --launch-cases h16:8192 2>&1 | tee "$out/profile_host.log" \
    | tail -13
  python3 benchmarks/bench_segments.py --out "$out/segments" \
    --cases h64:4096,h64:8192,h64:16384,h16:8192 --segment-pairs shipped,1024 2>&1 \
    | tee "$out/bench_segments.log" | tail -25
fi
if wants megatron; then
  python3 -m pytest -q -rA tests/gpu/test_megatron_gpu.py 2>&1 | tee "$out/pytest_megatron.log" \
    | grep -E "passed|failed|error" | tail -5
  python3 benchmarks/bench_megatron.py --out "$out/megatron" 2>&1 | tee "$out/bench_megatron.log" \
    | tail -8
fi
if wants compare; then
  # Run from inside each folder: `python -m` puts the working directory ahead of PYTHONPATH.
  for tree in ${OPENMSA_COMPARE_TREES:-} "$PWD"; do
    name=$(basename "$tree")
    (cd "$tree" && PYTHONPATH="$PWD" python3 -m openmsa.cli bench \
      ${OPENMSA_COMPARE_ARGS:---seqlens 32k,128k --no-flex --no-fla} --out "$out/compare-$name" \
      2>&1 | tee "$out/compare-$name.log" | tail -8; \
      python3 -c "import openmsa; print('package:', openmsa.__file__)")
  done
fi
if wants learn-probe; then
  # The ruler-gpu preset's dense model on its own batches through the 1024-token phase.
  python3 benchmarks/probe_lm_learning.py --preset ruler-gpu --steps 2800 --length 1024 \
    --every 200 --device cuda --out "$out/probe_ruler_gpu.json" ${OPENMSA_PROBE_ARGS:-} 2>&1 \
    | tee "$out/probe_ruler_gpu.log" | tail -n 4
fi
study_dir=${OPENMSA_STUDY_DIR:-runs/study}
if wants study; then
  study=(python3 benchmarks/quality_study.py --out "$study_dir"
         --stages "${OPENMSA_STUDY_STAGES:-train,adapt,eval,report}" ${OPENMSA_STUDY_ARGS:-})
  if [ -n "${OPENMSA_STUDY_BACKGROUND:-}" ]; then
    # A session of its own: the machine ends this call's processes when it returns, not this.
    mkdir -p "$study_dir"
    setsid nohup "${study[@]}" > "$study_dir/study.log" 2>&1 < /dev/null &
    echo $! > "$study_dir/study.pid"
    echo "study running in the background (pid $!); wait for it with the part study-wait"
  else
    "${study[@]}" 2>&1 | tee "$out/quality_study.log" | tail -12
  fi
fi
if wants study-wait; then
  pid=$(cat "$study_dir/study.pid")
  waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "${OPENMSA_STUDY_WAIT:-540}" ]; do
    sleep 10
    waited=$((waited + 10))
  done
  tail -n 12 "$study_dir/study.log"
  # Where each training run is: its log's last step line.
  for log in "$study_dir"/seed*/train_*.log; do
    [ -e "$log" ] && echo "$(basename "$log"): $(grep -a ' step ' "$log" | tail -n 1)"
  done
  # The weights are too large to come back from the machine; logs, histories and evaluations
  # are not. Packed on every call, so a session that ends before the study keeps its progress.
  tar czf "$out/study.tgz" --exclude='*.safetensors' -C "$study_dir" .
  if kill -0 "$pid" 2>/dev/null; then
    echo "study still running after ${waited} s (study.tgz: its progress so far): call the part study-wait again"
  else
    echo "study ended; everything but the weights is in study.tgz"
  fi
fi
if wants bench; then
  python3 -m openmsa.cli bench --seqlens 4k,16k,32k,64k,128k --out "$out/bench_h64" 2>&1 \
    | tee "$out/openmsa_bench_h64.log" | tail -17
  python3 -m openmsa.cli bench --preset h16 --seqlens 16k,32k --out "$out/bench_h16" 2>&1 \
    | tee "$out/openmsa_bench_h16.log" | tail -8
fi
