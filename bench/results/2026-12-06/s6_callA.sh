#!/usr/bin/env bash
# The sixth session's first H100 call: the CSA indexer op's GPU tests and its cost against the jnp path's key
# chunks, then the released slice's prefill with the attention and indexer kernels at 8k, 32k and 128k
# (its compiled prefills' largest buffers from an XLA dump). Logs to $OUT.
source "$(dirname "$0")/s5_build.sh"
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -n 4 -p no:cacheprovider \
  test_indexer_op.py test_csa_indexer.py test_attention_op.py 2>&1) >"$out/tests.log"
echo "== tests: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -15
L=8192 E=32768 timeout "${PROBE_TIMEOUT:-60}" python3 bench/results/2026-12-06/s6_indexer_op_probe.py \
  >"$out/indexer_op_probe.log" 2>&1
echo "== indexer probe: exit $?"; tail -8 "$out/indexer_op_probe.log"
start=$SECONDS
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*prefill.*" \
  timeout "${PREFILL_TIMEOUT:-300}" python3 bench/bench_prefill.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --prompt-lens ${PROMPT_LENS:-8192 32768 131072} --chunks 8192 --attention-impl kernel --reps 2 \
  --out "$out/prefill_kernel.json" >"$out/prefill_kernel.log" 2>&1
echo "== prefill kernel: exit $?, $((SECONDS - start)) s"; grep -v "^ *$" "$out/prefill_kernel.log" | tail -16
python3 bench/results/2026-12-06/s6_buffers.py /tmp/dump >"$out/prefill_buffers.txt" 2>&1; head -c 3000 "$out/prefill_buffers.txt"
