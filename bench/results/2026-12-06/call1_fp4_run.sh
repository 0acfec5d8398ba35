#!/usr/bin/env bash
# The driver of the session's one device call (H200, 2026-12-06, the working tree of 72ad280 on branch fp4; run as
# `cp -r .fp4/. . && bash fp4_run.sh` from a checkout of main with the branch's changed files in .fp4/): build (CPU
# native only: the MoE needs no CUDA handler), the FP4 sweep at decode sizes (device time per tiling), bench_moe with
# the default rule and with the sweep's best for 16-row tiles, the kernel's tests on the GPU. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
JAX_OC128_CUDA=OFF python3 -m pip install --no-build-isolation --no-deps -q . >$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee $OUT/env.txt
el built
SMALL=${SMALL:-"128,64,4,3 128,64,4,3,prefetch 128,64,4,1,prefetch 128,64,4,3,swap,prefetch 128,128,4,3,prefetch 128,64,4,3,split2 128,64,4,3,prefetch,split2 128,64,4,3,prefetch,split4"}
timeout ${SWEEP_TIMEOUT:-170} python3 bench/sweep_gmm.py --formats fp4 --tokens 8 64 --iters 10 --blocks $SMALL \
  --out $OUT/sweep_small.json >$OUT/sweep_small.log 2>&1; el "sweep small rc $?"
grep -E "^fp4" $OUT/sweep_small.log | sed -E 's/call [0-9.]+ \([0-9.]+x\) //g' | cut -c1-1500
best=$(python3 - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/sweep_small.json"))["rows"]
names = set.intersection(*(set(r["device_ms"]) for r in rows))
total = {b: sum(r["device_ms"][b] for r in rows) for b in names}
for b in sorted(total, key=total.get): print(f"{total[b]:.4f} {b}", file=__import__('sys').stderr)
print(min(total, key=total.get))
PY
)
el "best $best"
for which in before after; do
  extra=""; [ $which = after ] && extra="--blocks 16:$best"
  timeout 75 python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --dispatches grouped_pallas --rounds 2 \
    --profile /tmp/prof_$which $extra --out $OUT/bench_moe_fp4_$which.json >$OUT/bench_moe_fp4_$which.log 2>&1
  el "bench $which rc $?"; grep -E "^ +(8|64) |device, per call|copy bandwidth" $OUT/bench_moe_fp4_$which.log
done
(cd tests && timeout ${TEST_TIMEOUT:-110} python3 -m pytest -q -n 12 -p no:cacheprovider test_moe.py -m cuda 2>&1) >$OUT/pytest_moe_cuda.log
el "tests rc $?"; tail -5 $OUT/pytest_moe_cuda.log; grep -E "^(FAILED|ERROR)" $OUT/pytest_moe_cuda.log | head
