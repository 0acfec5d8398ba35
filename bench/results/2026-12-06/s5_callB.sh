#!/usr/bin/env bash
# The fifth session's second H100 call: the attention kernel of branch attn2 and the FP4 prefill-tile kernel of
# branch fp4big (their files laid over main's tree before this runs), their GPU tests and benchmarks; the CSA
# indexer's jnp cost per key chunk; the slice's decode step with the attention kernel. Logs to $OUT.
source "$(dirname "$0")/s5_build.sh"
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout 200 python3 -m pytest -q -n 4 -p no:cacheprovider test_attention_op.py \
  test_fp4_gmm_op.py test_moe.py 2>&1) >"$out/tests.log"
echo "== tests: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -15
timeout 90 python3 bench/bench_attention.py --out "$out/bench_attention.json" >"$out/bench_attention.log" 2>&1
echo "== bench_attention: exit $?"; grep -E "^\||TFLOP" "$out/bench_attention.log" | tail -14
timeout 150 python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 512 2048 8192 \
  --dispatches grouped_pallas grouped_fp4_op grouped --rounds 2 --out "$out/bench_moe.json" >"$out/bench_moe.log" 2>&1
echo "== bench_moe: exit $?"; grep -E "^\||floor|GB/s" "$out/bench_moe.log" | tail -20
timeout 60 python3 bench/results/2026-12-06/s5_indexer_probe.py >"$out/indexer_probe.log" 2>&1
echo "== indexer probe: exit $?"; cat "$out/indexer_probe.log" | tail -7
start=$SECONDS
timeout "${DECODE_TIMEOUT:-200}" python3 bench/bench_decode.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --backends online --modes plain --slots 8 --attention-impl kernel jnp --steps-per-dispatch 16 \
  --device-steps 32 --tokens 32 --out "$out/decode_attention.json" >"$out/decode_attention.log" 2>&1
echo "== decode kernel/jnp: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_attention.log" | tail -4
