#!/usr/bin/env bash
# Another commit's openmsa package in a folder of its own, to time beside this tree's in one GPU
# call (benchmarks/run_gpu.sh, part compare). The folder is ignored by git: carry it to the
# device machine by name.
#   bash tools/tree_copy.sh COMMIT [DIR]   (DIR defaults to runs/trees/COMMIT)
set -eu
commit=${1:?usage: tree_copy.sh COMMIT [DIR]}
dir=${2:-runs/trees/$commit}
rm -rf "$dir"
mkdir -p "$dir"
git archive "$commit" openmsa | tar x -C "$dir"
echo "$dir"
