"""@rules_cc for Bazel 4 offline: the C++ rules are Bazel's native ones (Debian's bazel-rules-cc needs a newer Bazel)."""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_library = native.objc_library
