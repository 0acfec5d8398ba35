"""The largest buffers of each compiled prefill in an XLA dump (argv[1]: the dump directory): per module,
its memory-usage report's head when XLA wrote one, and the 25 largest values of its buffer assignment
(name, shape, MiB). Prints to stdout."""

import pathlib
import re
import sys

VALUE = re.compile(r"value: <\d+ (\S+) @\S*> \(size=(\d+),offset=(\d+)\): (.*)$")

for path in sorted(pathlib.Path(sys.argv[1]).glob("*prefill*")):
    if path.name.endswith("memory-usage-report.txt"):
        print(f"== {path.name}")
        print("\n".join(path.read_text().splitlines()[:60]))
    elif path.name.endswith("buffer-assignment.txt"):
        values = {}
        for line in path.read_text().splitlines():
            match = VALUE.search(line.strip())
            if match:
                name, size, _, shape = match.groups()
                values[name] = (int(size), shape[:120])
        print(f"== {path.name}: {len(values)} values, largest:")
        for name, (size, shape) in sorted(values.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"{size / 2**20:10.1f} MiB  {name}  {shape}")
