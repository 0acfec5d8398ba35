"""The native modules as Python extensions (nanobind, NB_STATIC), CUDA sources compiled by nvcc, and pytest runs
against the Bazel-built package; flags from ffi/build.json, the paths from @oc128_config."""

load(
    "@oc128_config//:defs.bzl",
    "BUILD_JSON",
    "CUDA_ARCHITECTURES",
    "CXX_STD",
    "EXT_SUFFIX",
    "NVCC",
)

FLAGS = BUILD_JSON["release_flags"]

# nvcc's option for the C++ standard, as CMake passes it
CUDA_STD = "-std=c++%d" % BUILD_JSON["cxx_standard"]

def _nvcc_object_impl(ctx):
    compilation = cc_common.merge_cc_infos(cc_infos = [dep[CcInfo] for dep in ctx.attr.deps]).compilation_context
    out = ctx.actions.declare_file(ctx.label.name + ".pic.o")
    args = ctx.actions.args()
    args.add("-forward-unknown-to-host-compiler")
    args.add_all(FLAGS["nvcc_copts"])
    args.add(CUDA_STD)
    args.add_all(
        ["--generate-code=arch=compute_{0},code=[compute_{0},sm_{0}]".format(arch) for arch in CUDA_ARCHITECTURES],
    )
    args.add_all(compilation.defines, format_each = "-D%s")
    args.add_all(compilation.quote_includes, before_each = "-I")
    args.add_all(compilation.includes, before_each = "-I")
    args.add_all(compilation.system_includes, format_each = "-isystem=%s")
    args.add_all(["-x", "cu", "-c", ctx.file.src, "-o", out])
    ctx.actions.run(
        executable = NVCC,
        arguments = [args],
        inputs = depset([ctx.file.src], transitive = [compilation.headers]),
        outputs = [out],
        mnemonic = "NvccCompile",
        progress_message = "nvcc %s" % ctx.file.src.short_path,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([out]))]

nvcc_object = rule(
    implementation = _nvcc_object_impl,
    doc = "One CUDA source compiled by nvcc (ffi/build.json's nvcc_copts) into a position-independent object.",
    attrs = {
        "src": attr.label(allow_single_file = [".cu"], mandatory = True),
        "deps": attr.label_list(providers = [CcInfo], doc = "cc_libraries whose headers the source includes"),
    },
)

def nanobind_extension(name, module, srcs, deps = [], target_compatible_with = []):
    """The extension module ``module`` of ffi/build.json's package, as the pip build makes it.

    ``name`` is an alias of ``<package>/<module><EXT_SUFFIX>`` (the file Python imports); .cu sources are
    compiled by nvcc with ``deps``' headers and linked in."""
    cu = [src for src in srcs if src.endswith(".cu")]
    objects = []
    for src in cu:
        objects.append(name + "_" + src.split("/")[-1][:-len(".cu")])
        nvcc_object(
            name = objects[-1],
            src = src,
            deps = deps,
            target_compatible_with = target_compatible_with,
        )
    filename = "%s/%s%s" % (BUILD_JSON["package"], module, EXT_SUFFIX)
    native.cc_binary(
        name = filename,
        srcs = [src for src in srcs if src not in cu] + objects,
        copts = [CXX_STD] + FLAGS["module_copts"],
        linkopts = FLAGS["linkopts"],
        linkshared = True,
        deps = deps + ["@oc128_config//:nanobind"],
        target_compatible_with = target_compatible_with,
    )
    native.alias(name = name, actual = filename)

def pytest_test(name, tests, data = [], **kwargs):
    """pytest on ``tests`` with the package (//:jax_oc128) and its native modules from this workspace's build:
    bazel/pytest_main.py checks that Python imports those before it runs pytest."""
    native.py_test(
        name = name,
        srcs = ["//bazel:pytest_main.py"] + tests,
        main = "//bazel:pytest_main.py",
        args = ["$(rootpath %s)" % test for test in tests],
        data = data,
        deps = ["//:jax_oc128"],
        # no __init__.py made in tests/: pytest imports the test files and their helpers as top-level modules
        legacy_create_init = False,
        **kwargs
    )
