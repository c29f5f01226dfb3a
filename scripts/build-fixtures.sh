#!/usr/bin/env bash
# Rebuild the kernel fixtures of metrale-runtime's tests and benchmarks with nvcc
# (CUDA 13.0 made the committed ones):
#   kernels.ptx              PTX for compute_90           (from kernels.cu)
#   kernels.sm_90.cubin      cubin for sm_90
#   kernels.fatbin           sm_80 and sm_90 cubins plus compute_90 PTX
#   conditional.ptx          PTX for compute_90           (from conditional.cu)
#   conditional.sm_90.cubin  cubin for sm_90
# tma.ptx (the TMA copy of the tensor-map test) is hand-written PTX for sm_90a with
# no source, and so is args.ptx (args20, 20 parameters of mixed alignments, for the
# run-time argument-list tests); they are only checked here, with ptxas.
# Usage: scripts/build-fixtures.sh [OUTPUT_DIR]   (default: beside the source)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$root/metrale-runtime/tests/fixtures
src=$dir/kernels.cu
out=${1:-$dir}
mkdir -p "$out"
nvcc --version | tail -1
nvcc -ptx -arch=compute_90 -o "$out/kernels.ptx" "$src"
nvcc -cubin -arch=sm_90 -o "$out/kernels.sm_90.cubin" "$src"
nvcc -fatbin \
  -gencode arch=compute_80,code=sm_80 \
  -gencode arch=compute_90,code='[sm_90,compute_90]' \
  -o "$out/kernels.fatbin" "$src"
nvcc -ptx -arch=compute_90 -o "$out/conditional.ptx" "$dir/conditional.cu"
nvcc -cubin -arch=sm_90 -o "$out/conditional.sm_90.cubin" "$dir/conditional.cu"
ptxas -arch=sm_90a "$dir/tma.ptx" -o /dev/null && echo "tma.ptx: ptxas sm_90a ok"
ptxas -arch=sm_90 "$dir/args.ptx" -o /dev/null && echo "args.ptx: ptxas sm_90 ok"
ls -l "$out"/kernels.* "$out"/conditional.*
