"""oc128_configure: the repository @oc128_config, made from what is installed here (nothing is downloaded).

It asks the Python that has jax and nanobind installed ($PYTHON_BIN_PATH, else python3 on $PATH) for its
headers and extension suffix, nanobind's sources and the XLA FFI headers (bazel/python_config.py), links them
into the repository and defines:

  //:python_headers, //:nanobind (nanobind's core, from its wheel), //:xla_ffi   cc_library
  //:cudart_static                                                              cc_library (where nvcc is found)
  //:python_toolchain    the Python toolchain running py_binary/py_test with that Python
  //:defs.bzl           EXT_SUFFIX, BUILD_JSON (ffi/build.json), CXX_STD, NVCC, CUDA_ARCHITECTURES, CMAKE and the
                        target_compatible_with of targets that need nvcc / cmake

As in the pip build, JAX_OC128_CUDA=AUTO|ON|OFF says whether to build the CUDA module (AUTO: where nvcc is on
$PATH) and JAX_OC128_CUDA_ARCHS (e.g. "80;90") overrides ffi/build.json's CUDA architectures.
"""

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")
load(":defs.bzl", "BUILD_JSON", "CUDA_COMPATIBLE_WITH", "CXX_STD")

package(default_visibility = ["//visibility:public"])

# Targets that need a tool this repository did not find (nvcc, cmake) are compatible only with platforms having
# its constraint value, which none has: `bazel build //...` skips them.
constraint_setting(name = "nvcc")

constraint_value(
    name = "nvcc_found",
    constraint_setting = ":nvcc",
)

constraint_setting(name = "cmake")

constraint_value(
    name = "cmake_found",
    constraint_setting = ":cmake",
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "xla_ffi",
    hdrs = glob(["xla_ffi_include/xla/ffi/api/*.h"]),
    includes = ["xla_ffi_include"],
)

cc_library(
    name = "robin_map",
    hdrs = glob(["nanobind/ext/robin_map/include/**/*.h"]),
    includes = ["nanobind/ext/robin_map/include"],
    visibility = ["//visibility:private"],
)

# nanobind's core compiled once into the modules that link it (NB_STATIC), from nb_combined.cpp: the single
# translation unit nanobind provides for build systems other than CMake.
cc_library(
    name = "nanobind",
    srcs = ["nanobind/src/nb_combined.cpp"],
    hdrs = glob(["nanobind/include/**/*.h"]),
    copts = [CXX_STD] + BUILD_JSON["release_flags"]["library_copts"],
    includes = ["nanobind/include"],
    textual_hdrs = glob(
        ["nanobind/src/*.h", "nanobind/src/*.cpp"],
        exclude = ["nanobind/src/nb_combined.cpp"],
    ),
    deps = [
        ":python_headers",
        ":robin_map",
    ],
    alwayslink = True,
)

cc_library(
    name = "cudart_static",
    srcs = {cudart_srcs},
    linkopts = ["-ldl", "-lrt", "-lpthread"],
    target_compatible_with = CUDA_COMPATIBLE_WITH,
)

py_runtime(
    name = "python3",
    interpreter_path = {python},
    python_version = "PY3",
)

py_runtime_pair(
    name = "python_runtimes",
    py3_runtime = ":python3",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":python_runtimes",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

_DEFS = """\
# Made by bazel/configure.bzl for this machine.
EXT_SUFFIX = {ext_suffix}
BUILD_JSON = {build_json}
CXX_STD = "-std=gnu++%d" % BUILD_JSON["cxx_standard"]  # as CMake passes it (CMAKE_CXX_EXTENSIONS is on)
NVCC = {nvcc}
CUDA_ARCHITECTURES = {cuda_architectures}
CUDA_COMPATIBLE_WITH = {cuda_compatible_with}
CMAKE = {cmake}
CMAKE_COMPATIBLE_WITH = {cmake_compatible_with}
"""

def _python_config(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH") or rctx.which("python3")
    if not python:
        fail("oc128_configure: no python3 on PATH; set PYTHON_BIN_PATH to the Python that has jax and nanobind")
    result = rctx.execute([python, rctx.path(Label("//bazel:python_config.py"))])
    if result.return_code != 0:
        fail("oc128_configure: %s failed:\n%s" % (python, result.stderr))
    return json.decode(result.stdout)

def _nvcc(rctx):
    """nvcc's path and the CUDA toolkit's directory, or (None, None) where the CUDA module is not built."""
    mode = rctx.os.environ.get("JAX_OC128_CUDA", "AUTO").upper()
    if mode not in ("AUTO", "ON", "OFF"):
        fail("JAX_OC128_CUDA: expected AUTO, ON or OFF, got %r" % mode)
    nvcc = rctx.which("nvcc") if mode != "OFF" else None
    if not nvcc:
        if mode == "ON":
            fail("JAX_OC128_CUDA=ON but there is no nvcc on PATH")
        return None, None
    result = rctx.execute([nvcc, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"])
    for line in result.stderr.splitlines():
        if line.startswith("#$ TOP="):
            return str(nvcc), line[len("#$ TOP="):]
    fail("oc128_configure: %s --dryrun did not name its toolkit directory (TOP):\n%s" % (nvcc, result.stderr))

def _oc128_configure_impl(rctx):
    python = _python_config(rctx)
    rctx.symlink(python["python_include"], "python_include")
    rctx.symlink(python["nanobind"], "nanobind")
    rctx.symlink(python["xla_ffi_include"], "xla_ffi_include")
    build_json = json.decode(rctx.read(Label("//:ffi/build.json")))

    nvcc, cuda_dir = _nvcc(rctx)
    if nvcc:
        rctx.symlink(cuda_dir + "/lib64/libcudart_static.a", "cuda/libcudart_static.a")
    archs = rctx.os.environ.get("JAX_OC128_CUDA_ARCHS") or build_json["cuda_architectures"]
    cmake = rctx.which("cmake")

    rctx.file("BUILD", _BUILD.format(
        cudart_srcs = repr(["cuda/libcudart_static.a"] if nvcc else []),
        python = repr(python["python"]),
    ))
    rctx.file("defs.bzl", _DEFS.format(
        ext_suffix = repr(python["ext_suffix"]),
        build_json = repr(build_json),
        nvcc = repr(nvcc),
        cuda_architectures = repr(archs.split(";")),
        cuda_compatible_with = repr([] if nvcc else ["@%s//:nvcc_found" % rctx.name]),
        cmake = repr(str(cmake) if cmake else None),
        cmake_compatible_with = repr([] if cmake else ["@%s//:cmake_found" % rctx.name]),
    ))

oc128_configure = repository_rule(
    implementation = _oc128_configure_impl,
    environ = ["PATH", "PYTHON_BIN_PATH", "JAX_OC128_CUDA", "JAX_OC128_CUDA_ARCHS"],
    local = True,
)
