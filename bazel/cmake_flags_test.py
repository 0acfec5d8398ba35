"""ffi/build.json's release_flags agree with CMake.

Configures the pip build's CMakeLists.txt as scikit-build-core does (Release, this Python) and checks that
each compile of the native modules and of nanobind's core, and each module's link, gets from CMake
(nanobind_add_module(NB_STATIC), the Release build type) the flags the Bazel build passes from build.json
(bazel/defs.bzl, bazel/configure.bzl). A compile's flags are compared as the compiler sees them: the last -O
level and the set of the others, without paths (includes, outputs, dependency files) and the source.

    cmake_flags_test.py --cmake=CMAKE [--nvcc=NVCC]   (with NVCC: the CUDA module too)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

REPOSITORY = pathlib.Path(__file__).parents[1]

# What Bazel's --compilation_mode=opt (.bazelrc) gives every compile of a shared library, before the copts
BAZEL_OPT = ["-O2", "-DNDEBUG", "-fPIC"]
# Options followed by a path (-x: by a language)
PATH_OPTIONS = {"-o", "-MT", "-MF", "-I", "-isystem", "-x", "--options-file"}


def effective(command: list[str]) -> tuple[str | None, set[str]]:
    """(the last -O option, the other options) of a compiler command, without its paths and its source."""
    options, tokens = [], iter(command[1:])
    for token in tokens:
        if token in PATH_OPTIONS:
            next(tokens)
        elif not token.startswith(("-I", "-isystem", "/")) and token not in ("-c", "-MD"):
            options.append(token)
    options = [option for option in options if not option.endswith("_EXPORTS")]  # CMake's -D<target>_EXPORTS
    levels = [option for option in options if option.startswith("-O")]
    return (levels[-1] if levels else None), {option for option in options if not option.startswith("-O")}


def bazel_flags(config: dict) -> dict[str, list[str]]:
    """kind of compile -> the options the Bazel build passes, in order."""
    flags, std = config["release_flags"], config["cxx_standard"]
    archs = config["cuda_architectures"].split(";")
    return {
        "library": [*BAZEL_OPT, f"-std=gnu++{std}", *flags["library_copts"]],
        "module": [*BAZEL_OPT, f"-std=gnu++{std}", *flags["module_copts"]],
        "cuda": [
            "-forward-unknown-to-host-compiler",
            *flags["nvcc_copts"],
            f"-std=c++{std}",
            *(f"--generate-code=arch=compute_{a},code=[compute_{a},sm_{a}]" for a in archs),
        ],
    }


def kind(entry: dict) -> str:
    """The kind of compile (a key of bazel_flags) of an entry of compile_commands.json."""
    if "/nanobind-static.dir/" in entry["command"]:
        return "library"
    return "cuda" if entry["file"].endswith(".cu") else "module"


def configure(cmake: str, nvcc: str) -> pathlib.Path:
    """The CMake build directory of this repository, configured (the CUDA module with nvcc, if given)."""
    build = pathlib.Path(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")))
    cuda = [f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DJAX_OC128_CUDA=ON"] if nvcc else ["-DJAX_OC128_CUDA=OFF"]
    command = [cmake, "-S", REPOSITORY, "-B", build, "-G", "Unix Makefiles", "-DCMAKE_BUILD_TYPE=Release"]
    command += [f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", *cuda]
    subprocess.run(command, check=True)
    return build


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cmake", required=True)
    parser.add_argument("--nvcc", default="")
    args = parser.parse_args()
    config = json.loads((REPOSITORY / "ffi" / "build.json").read_text())
    build = configure(args.cmake, args.nvcc)

    expected = {name: effective(["compiler", *flags]) for name, flags in bazel_flags(config).items()}
    failures, compiled = [], set()
    for entry in json.loads((build / "compile_commands.json").read_text()):
        name = kind(entry)
        got = effective(shlex.split(entry["command"]))
        compiled.add(name)
        if got != expected[name]:
            failures.append(
                f"{entry['file']} ({name}): CMake {got}, ffi/build.json {expected[name]}\n"
                f"  only CMake: {sorted(got[1] - expected[name][1])}\n"
                f"  only build.json: {sorted(expected[name][1] - got[1])}"
            )
    linkopts = sorted(config["release_flags"]["linkopts"])
    for module in ("cpu", "cuda") if args.nvcc else ("cpu",):
        link = shlex.split((build / "CMakeFiles" / f"oc128_{module}.dir" / "link.txt").read_text())
        got = sorted(token for token in link if token.startswith("-Wl,"))
        if got != linkopts:
            failures.append(f"link of {module}: CMake {got}, ffi/build.json {linkopts}")
    kinds = {"library", "module", "cuda"} if args.nvcc else {"library", "module"}
    if compiled != kinds:
        failures.append(f"CMake compiled {sorted(compiled)}, expected {sorted(kinds)}")
    print("\n".join(failures) or f"CMake passes ffi/build.json's flags to {sorted(compiled)} and the links")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
