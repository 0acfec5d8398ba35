#!/usr/bin/env bash
# The twelfth session's third GPU call, on main with branch idxdecode laid over it: the released slice's plain
# decode step at a 4k context, 8 slots, device-only, then the same with branch hcfuse's hyper_connections.py laid
# over the installed package (a Python file, no build; put beside this script as hcfuse_hyper_connections.py
# for the call, from `git show fd02a07:jax_oc128/nn/hyper_connections.py`): its step time and its compile time
# (the first call's 4k row, with hcfuse, spent its 220 s limit compiling). ~420 s on an H100.
source "$(dirname "$0")/../2026-12-06/s5_build.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=.95
row() {  # $1: a name for the logs
  start=$SECONDS
  timeout "${ROW_TIMEOUT:-210}" python3 bench/bench_decode.py --configs v4flash-slice --layers 6 --experts 256 \
    --weights released --backends online --modes plain --slots 8 --steps-per-dispatch 16 --prompt-len 3072 \
    --device-only --device-steps 64 --max-len 4096 --out "$out/decode_3072_$1.json" >"$out/decode_3072_$1.log" 2>&1
  echo "== decode 4k $1: exit $?, $((SECONDS - start)) s"; grep -E "^\| v4" "$out/decode_3072_$1.log" | tail -1
  grep -E " s$" "$out/decode_3072_$1.log" | tail -4
}
row idxdecode
pkg=$(cd /tmp && python3 -c "import jax_oc128, os; print(os.path.dirname(jax_oc128.__file__))")
rm -rf /tmp/hc && mkdir -p /tmp/hc && cp -r "$pkg" /tmp/hc/
cp "$(dirname "$0")/hcfuse_hyper_connections.py" /tmp/hc/jax_oc128/nn/hyper_connections.py
PYTHONPATH=/tmp/hc:${PYTHONPATH:-} python3 -c "import jax_oc128.nn.hyper_connections as h; print(h.__file__)"
PYTHONPATH=/tmp/hc:${PYTHONPATH:-} ROW_TIMEOUT=${HC_TIMEOUT:-260} row hcfuse
