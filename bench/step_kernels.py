"""Where a profiled decode step's device time goes, by the model's named scopes.

``bench_decode.py --profile DIR`` traces one dispatch per row; with XLA's command buffers off
(``XLA_FLAGS=--xla_gpu_enable_command_buffer=``) the trace lists each kernel of the loop (in a CUDA graph the
profiler sees the graph only). Each kernel is attributed to the ``jax.named_scope`` path of the HLO
instruction it runs (the model's scopes: ``target`` / ``draft``, ``attention``, ``compressor``, ``mlp``,
``route``, ``routed_experts``, ``shared_expert``, ``hyper_connection``, ``lm_head``): from the trace's own
``tf_op`` when the profiler records it, otherwise from an HLO dump of the decode module
(``--xla_dump_to=HLO --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_decode``), by the instruction's
``op_name`` metadata. Prints, per step, each scope path's kernel microseconds, share and kernel count, and the
largest kernels of the scopes asked for (``--detail``; ``-`` for the kernels of no scope), a copy
(``MemcpyD2D``) named by its HLO instruction and result type. ``bench/gpu_run.sh``'s ``profile`` stage runs
it on the V4-Flash slice.

    python bench/step_kernels.py DIR/ROW --steps 16 [--hlo HLO] [--detail target/mlp/routed_experts -]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re

from bench_ops import kernel_events

#: the model's named scopes, outermost first (jax_oc128.engine.steps, nn.model, nn.attention, nn.moe)
SCOPES = (
    "target",
    "draft",
    "attention",
    "compressor",
    "mlp",
    "route",
    "routed_experts",
    "shared_expert",
    "hyper_connection",
    "lm_head",
)
INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.-]+) = (\S+) .*op_name="([^"]*)"')


def hlo_op_names(dump: pathlib.Path) -> dict[str, dict[str, tuple[str, str]]]:
    """HLO module name -> instruction name -> ``(op_name, result type)``, from the after-optimizations text
    dumps under ``dump``."""
    modules = {}
    for path in dump.glob("*after_optimizations.txt"):
        text = path.read_text()
        module = re.search(r"^HloModule ([\w.-]+)", text, re.M).group(1)
        names = modules.setdefault(module, {})
        for line in text.splitlines():
            match = INSTRUCTION.match(line)
            if match:
                names[match.group(1)] = (match.group(3), match.group(2))
    return modules


def scope_of(op_name: str) -> str:
    """The model's scopes in ``op_name`` (a jax name stack), joined by ``/``; ``-`` for none."""
    found = [part for part in op_name.split("/") if part in SCOPES]
    return "/".join(dict.fromkeys(found)) or "-"


def attribute(events, steps: int, modules: dict) -> tuple[dict, dict, dict, int]:
    """``(us per step by scope path, kernels per step by scope path, us per step by (scope, kernel), kernels
    not attributed)``: a kernel is its name, and where the trace names another HLO instruction (a copy's
    ``MemcpyD2D``) that instruction and its result type."""
    by_scope, counts, by_kernel = collections.Counter(), collections.Counter(), collections.Counter()
    unknown = 0
    for event in events:
        args = event.get("args", {})
        hlo_op = args.get("hlo_op", event["name"])
        names = modules.get(args.get("hlo_module", ""), {})
        if not names:  # no module name in the trace: any dumped module holding the instruction
            names = next((n for n in modules.values() if hlo_op in n), {})
        op_name, result = names.get(hlo_op, ("", ""))
        op_name = args.get("tf_op") if "/" in args.get("tf_op", "") else op_name
        if not op_name:
            unknown += 1
        scope = scope_of(op_name)
        kernel = event["name"] if hlo_op == event["name"] else f"{event['name']} {hlo_op} {result}".strip()
        by_scope[scope] += event["dur"] / steps
        counts[scope] += 1 / steps
        by_kernel[scope, kernel] += event["dur"] / steps
    return by_scope, counts, by_kernel, unknown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a row's profile directory (bench_decode.py --profile DIR/ROW)")
    parser.add_argument("--steps", type=int, required=True, help="decode steps in the traced dispatch")
    parser.add_argument("--hlo", default=None, help="an XLA HLO dump directory of the decode module")
    parser.add_argument("--detail", nargs="*", default=[], help="scope paths whose kernels are listed")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per detailed scope")
    args = parser.parse_args()
    events = kernel_events(pathlib.Path(args.trace))
    sample = events[len(events) // 2]["args"] if events else {}
    print(f"{len(events)} kernels; a kernel event's args: {sorted(sample)}")
    modules = hlo_op_names(pathlib.Path(args.hlo)) if args.hlo else {}
    by_scope, counts, by_kernel, unknown = attribute(events, args.steps, modules)
    total = sum(by_scope.values())
    print(
        f"per step: kernels {total:.1f} us, {sum(counts.values()):.0f} kernels; {unknown} kernels of no "
        "op_name (scope '-')"
    )
    for scope, us in by_scope.most_common():
        print(f"  {us:9.1f} us  {us / total:6.1%}  {counts[scope]:6.1f} kernels  {scope}")
    for scope in args.detail:
        print(f"{scope}:")
        kernels = [(name, us) for (s, name), us in by_kernel.most_common() if s == scope]
        for name, us in kernels[: args.top]:
            print(f"  {us:9.1f} us  {name[:100]}")


if __name__ == "__main__":
    main()
