#!/usr/bin/env bash
# The twelfth session's first GPU call, on main with branches fp4pipe (the FP4/FP8 decode kernel's cp.async
# pipeline), hcfuse (the hyper-connections' contractions elementwise) and idxdecode (the indexer's q.k on the
# tensor cores, exact) laid over it: their GPU tests, the FP4 MoE layer in a loop of 8 at 8 and 64 tokens
# (profiled), the released slice's plain decode step at a 4k context, 8 slots, device-only. ~480 s on an H100.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=.95
start=$SECONDS
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -n 4 -q -p no:cacheprovider \
  test_quant_gmm_op.py test_csa_indexer.py test_hyper_connections.py test_indexer_op.py \
  "test_moe.py" -k "quant or fp4 or indexer or csa or hyper or Hyper" >"$out/tests.log" 2>&1)
echo "== tests: exit $?, $((SECONDS - start)) s"; tail -6 "$out/tests.log"
start=$SECONDS
timeout "${MOE_TIMEOUT:-120}" python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --dispatches grouped \
  --loop 8 --rounds 2 --profile /tmp/moe_prof --out "$out/moe_loop.json" >"$out/moe_loop.log" 2>&1
echo "== moe loop: exit $?, $((SECONDS - start)) s"; sed -n '/^ms per MoE/,$p' "$out/moe_loop.log" | grep -v "^wrote" | head -40
start=$SECONDS
timeout "${ROW_TIMEOUT:-220}" python3 bench/bench_decode.py --configs v4flash-slice --layers 6 --experts 256 \
  --weights released --backends online --modes plain --slots 8 --steps-per-dispatch 16 --prompt-len 3072 \
  --device-only --device-steps 64 --max-len 4096 --out "$out/decode_3072.json" >"$out/decode_3072.log" 2>&1
echo "== decode 4k: exit $?, $((SECONDS - start)) s"; grep -E "^\|" "$out/decode_3072.log" | tail -3
grep -E "s$" "$out/decode_3072.log" | grep -v "^|" | tail -5
