"""What in a compiled XLA program does work of given sizes (e.g. those that follow ``max_len``): the
instructions of its optimized HLO text (``compiled.as_text()``) whose result has a dimension of one of the
sizes, other than those that only name an array or update part of it in place: a conversion, a copy, a
select or a broadcast of the whole array, or a fusion that computes one. Inside a fusion only its result
counts (a conversion of an operand there is computed only where the fusion reads it)."""

from __future__ import annotations

import re

#: instructions (and fusion roots) that name an array or write part of it in place
IN_PLACE = frozenset(
    ("parameter", "get-tuple-element", "tuple", "bitcast", "scatter", "dynamic-update-slice", "while")
)
#: ``%name = type[dims]{layout} opcode(`` (a tuple-shaped result does not match: it names arrays)
INSTRUCTION = re.compile(r"%(\S+) = [a-z0-9]+\[([0-9,]*)\]\S* ([a-z-]+)\(")
CALLS = re.compile(r"calls=%([\w.\-]+)")


def computations(hlo: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of ``hlo`` by its name."""
    found, name = {}, None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            name = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            found[name] = []
        elif name is not None and line.startswith(" "):
            found[name].append(line)
    return found


def sized(hlo: str, sizes) -> list[tuple[str, str, str]]:
    """``(name, dims, opcode)`` of every instruction of ``hlo`` outside fused computations whose result has
    a dimension in ``sizes`` (ints) and that is not in :data:`IN_PLACE` (a fusion: by its root's opcode)."""
    sizes = {str(size) for size in sizes}
    bodies = computations(hlo)
    fused = {
        name
        for lines in bodies.values()
        for line in lines
        if " fusion(" in line
        for name in CALLS.findall(line)
    }
    roots = {}
    for name in fused:
        root = next((line for line in bodies.get(name, []) if line.lstrip().startswith("ROOT")), "")
        match = INSTRUCTION.search(root)
        roots[name] = match.group(3) if match else "fusion"
    found = []
    for name, lines in bodies.items():
        if name in fused:
            continue
        for line in lines:
            match = INSTRUCTION.search(line)
            if match is None or not sizes & set(match.group(2).split(",")):
                continue
            opcode = match.group(3)
            if opcode == "fusion":
                opcode = roots.get(CALLS.search(line).group(1), "fusion")
            if opcode not in IN_PLACE:
                found.append((match.group(1), match.group(2), opcode))
    return found


def shapes(hlo: str) -> set[tuple[int, ...]]:
    """The result shapes of every instruction of ``hlo``, those inside fused computations included (what the
    program addresses as an array, materialized or not)."""
    return {
        tuple(int(dim) for dim in match.group(2).split(",") if dim)
        for lines in computations(hlo).values()
        for line in lines
        if (match := INSTRUCTION.search(line))
    }
