import gc
import os
import shutil
import tempfile

# Before jax starts a backend:
# - one persistent compilation cache per test run, shared by the xdist workers and by the processes that tests
#   start (the CLI, the examples, tests/multidevice) through the inherited environment: many tests compile the
#   same programs (the shipped model's engine above all). Per run, never across runs, so a rebuilt native
#   module never meets executables compiled against the previous one. A cache the caller set is used as is.
# - on a GPU: no GEMM autotuning (it runs candidate kernels for every GEMM shape of every compilation, and the
#   tests check values, not speed), and no preallocation (the xdist workers share one GPU).
OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_oc128_tests_cache_")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

from jax_oc128 import pretrained  # noqa: E402

# tests/multidevice needs 4 devices from the start of its process: tests/test_multidevice.py runs it so
collect_ignore = ["multidevice"]

# The quick lane (`pytest -m quick`, README): a few cheap tests that cover each area once, named here
# ("file::test", or one parametrized case "file::test[id]") so that the test files stay as their owners write
# them. Under `-m quick`, a name matching no test of a file that was collected is an error (a renamed test
# would leave the lane silently).
QUICK = (
    # the native ops against the reference: compress, then verify and commit
    "test_compress.py::test_prefill_crossing_several_blocks_with_ragged_rows",
    "test_verify_commit.py::test_case_matrix[126-4]",
    # the controller: a commit kept pending across other forwards
    "test_controller.py::test_pending_commit_survives_unrelated_forwards_and_idle",
    # the model: one C128 layer against transformers, a verify against decoding one by one
    "test_nn.py::test_matches_transformers[hca-online-full]",
    "test_nn.py::test_verify_equals_decoding_one_by_one[closes-mid-verify-online]",
    # the engine: greedy speculation equals plain greedy
    "test_decode.py::test_greedy_speculation_equals_plain_greedy[online-N=4]",
    # the loaders: a transformers-named safetensors file, the shipped format's round trip
    "test_pretrained.py::test_single_file_with_transformers_names[small_window]",
    "test_checkpoint.py::test_saved_model_loads_back_exactly[bfloat16]",
    # the command line and the server's flags
    "test_cli.py::test_info_names_versions_and_targets",
    "test_cli.py::test_bad_demo_flags_are_refused_before_anything_compiles",
    "test_serve.py::test_serve_flags_are_checked",
    # the server live: completions and chat equal generate
    "test_serve.py::test_completions_and_chat_equal_generate",
)


def mark_quick(config, items):
    """Marks the :data:`QUICK` tests ``quick``; under ``-m quick``, a name that matches no collected test of
    its (collected) file is a usage error."""
    files = {item.path.name for item in items}
    matched = set()
    for item in items:
        name = f"{item.path.name}::{item.name}"
        for quick in QUICK:
            if name == quick or (name.startswith(quick + "[") and "[" not in quick):
                item.add_marker(pytest.mark.quick)
                matched.add(quick)
    missing = [quick for quick in QUICK if quick.split("::")[0] in files and quick not in matched]
    if missing and "quick" in config.getoption("markexpr", ""):
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that do not exist: {missing}")


def pytest_collection_modifyitems(config, items):
    """`cuda` tests need a CUDA device (skipped without one; JAX_OC128_REQUIRE_GPU=1 makes a missing GPU a
    failure) and belong to the `gpu` lane, which also holds the tests that cover the controller, a model and
    the engine on whatever the default device is. The :data:`QUICK` tests are marked `quick`."""
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.gpu)
    mark_quick(config, items)
    if jax.default_backend() == "gpu":
        return
    if os.environ.get("JAX_OC128_REQUIRE_GPU") == "1":
        raise pytest.UsageError("JAX_OC128_REQUIRE_GPU=1 but jax has no GPU backend")
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n``) without a ``--dist`` of the caller's: work stealing. The default ``load``
    hands each worker its chunk of tests ahead, and a worker whose chunk holds the slow engine tests ran
    alone at the end of a GPU run while the others idled; with work stealing an idle worker takes half of
    the longest queue (each worker's tests stay contiguous, so module fixtures are built as rarely)."""
    chosen = any(arg == "-d" or arg.startswith("--dist") for arg in config.invocation_params.args)
    if chosen or config.getoption("dist") != "load":
        return None
    try:
        from xdist.scheduler import WorkStealingScheduling  # pytest-xdist >= 3.2
    except ImportError:
        return None
    return WorkStealingScheduling(config, log)


@pytest.fixture(autouse=True, scope="module")
def release_executables():
    """Drops jax's compiled programs after each module. XLA's CPU backend maps every loaded executable's code
    into memory with its own mappings and keeps them while the executable lives: a whole serial run of the
    suite in one process (CI's) went past Linux's limit of 65530 mappings per process (vm.max_map_count) and
    died of a segmentation fault where the next one was mapped. Programs a later module needs again come
    back from the run's persistent compilation cache."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def nothing_placed(monkeypatch):
    """Fails the test if the loading pipeline (``load_pretrained``, ``from_hf``) places a tensor into a model
    (every check must come before)."""

    def refuse(*args):
        raise AssertionError("a tensor was placed before the checks failed")

    monkeypatch.setattr(pretrained, "place", refuse)


def pytest_unconfigure(config):
    if OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
