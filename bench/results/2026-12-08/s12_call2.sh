#!/usr/bin/env bash
# The twelfth session's second GPU call, on main with branch idxdecode (the indexer's q.k on the tensor cores,
# exact; its parts cut by bits) laid over it: the indexer's GPU tests, the FP4 MoE layer in a loop on main's
# decode kernel (the base for fp4pipe's row of the first call), and the released slice's decode at a 32k context
# profiled by scope at 64 slots (section 39's row: the CSA indexer ~790 us a layer). ~450 s on an H100.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
start=$SECONDS
(cd tests && JAX_OC128_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -n 4 -q -p no:cacheprovider \
  test_csa_indexer.py test_indexer_op.py >"$out/tests.log" 2>&1)
echo "== tests: exit $?, $((SECONDS - start)) s"; tail -4 "$out/tests.log"
start=$SECONDS
timeout "${MOE_TIMEOUT:-90}" python3 bench/bench_moe.py --experts-format fp4 --tokens 8 64 --dispatches grouped \
  --loop 8 --rounds 2 --profile /tmp/moe_prof --out "$out/moe_loop_base.json" >"$out/moe_loop_base.log" 2>&1
echo "== moe loop (main's kernel): exit $?, $((SECONDS - start)) s"; sed -n '/^ms per MoE/,$p' "$out/moe_loop_base.log" | grep -v "^wrote" | grep -v "  us  [^v]" | head -12
SLOTS=64 PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-330} bash "$(dirname "$0")/../2026-12-07/s10_profile_32k.sh" 2>&1 | tail -120
