#!/usr/bin/env bash
# Issue 42: the FP4 decode kernel's constants (ffi/quant_gmm_cuda.cu) swept on its own, no JAX: quant_gmm_probe.cu
# built once per variant (in parallel), then each run in turn. Variants (VARIANTS picks some):
#   base   kGroups 2 (32 weight rows a block), kWarps 8, kMinBlocks 4: the kernel as it is
#   g4     kGroups 4 (64 weight rows a block), kMinBlocks 2
#   w4     kWarps 4
#   g4w4   kGroups 4, kWarps 4, kMinBlocks 2
#   mb2    kMinBlocks 2
#   mb3    kMinBlocks 3
#   g1mb4  kGroups 1 (16 weight rows a block)
# Run from the repository root; logs to $OUT. ~1 minute on an H100.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
here=$(dirname "$0")
inc=$(cd /tmp && python3 -c "from jax import ffi; print(ffi.include_dir())")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/probe_env.txt"
declare -A sed_of=(
  [base]="" [g4]="s/kGroups = 2;/kGroups = 4;/; s/kMinBlocks = 4;/kMinBlocks = 2;/" [w4]="s/kWarps = 8;/kWarps = 4;/"
  [g4w4]="s/kGroups = 2;/kGroups = 4;/; s/kWarps = 8;/kWarps = 4;/; s/kMinBlocks = 4;/kMinBlocks = 2;/"
  [mb2]="s/kMinBlocks = 4;/kMinBlocks = 2;/" [mb3]="s/kMinBlocks = 4;/kMinBlocks = 3;/"
  [g1mb4]="s/kGroups = 2;/kGroups = 1;/"
)
variants=${VARIANTS:-base g4 w4 g4w4 mb2 mb3}
for v in $variants; do
  (src=/tmp/qgp_$v; rm -rf "$src"; mkdir -p "$src"; cp ffi/*.h "$src/"
   sed "${sed_of[$v]}" ffi/quant_gmm_cuda.cu >"$src/quant_gmm_cuda.cu"
   nvcc -O3 -std=c++17 -arch=sm_90a -Xptxas -v -I "$src" -I "$inc" -o "$src/probe" "$here/quant_gmm_probe.cu" \
     >"$out/probe_build_$v.log" 2>&1 || echo "== $v: build failed") &
done
wait
for v in $variants; do
  echo "== $v (FP4 kernel: $(grep -A4 "Compiling entry.*quant_gmm_kernelILNS_6FormatE0E" "$out/probe_build_$v.log" \
    | grep -oE "[0-9]+ bytes spill stores|Used [0-9]+ registers" | tr '\n' ' '))"
  [ -x "/tmp/qgp_$v/probe" ] && timeout 60 "/tmp/qgp_$v/probe" 2>&1 | tee "$out/probe_$v.log"
done
