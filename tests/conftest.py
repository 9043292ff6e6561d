"""Shared test setup.

* Without CUDA, ``TRITON_INTERPRET=1`` is set *before* triton is imported (by
  anything), so kernels run in the CPU interpreter.
* In the interpreter, fp32 -> bf16 casts round to nearest even as on a GPU
  (``tests_support_interp.bf16_round_to_nearest``; the interpreter truncates), and each element of a dot is the
  correctly rounded sum of its products whatever the tile's shape (``tests_support_interp.exact_dots``).
* ``device`` fixture: "cuda" when present, else "cpu".
* ``@pytest.mark.gpu``: needs a real GPU (real shapes, CUDA graphs, timings of
  nothing); skipped without CUDA, run on a GPU machine.
* Tests seed torch per test so each is reproducible on its own.
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from evenflow import _runtime  # noqa: E402

if _runtime.interpreting():
    # the interpreter truncates fp32 -> bf16 casts; make them round to nearest even as on a GPU; and its dots'
    # sums depend on the tile's shape through the BLAS kernel: make each element the correctly rounded sum
    from tests_support_interp import bf16_round_to_nearest, exact_dots  # noqa: E402

    bf16_round_to_nearest()
    exact_dots()


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shards (1 <= K <= N): test functions dealt round robin in collection "
                          "order, a function's parametrisations kept together (they share compiled kernels); for a "
                          "GPU suite longer than one session on the GPU machine allows")


def _shard(spec: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard: expected K/N with integers, got {spec!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard: K must be in 1..N, got {spec!r}")
    return k, n


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU-only machines")
    if config.getoption("--shard"):
        _shard(config.getoption("--shard"))


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec:
        k, n = _shard(spec)
        order: dict[str, int] = {}
        for item in items:  # each test function's place among the distinct functions, in collection order
            order.setdefault(item.nodeid.split("[")[0], len(order))
        keep = [order[item.nodeid.split("[")[0]] % n == k - 1 for item in items]
        config.hook.pytest_deselected(items=[item for item, kept in zip(items, keep) if not kept])
        items[:] = [item for item, kept in zip(items, keep) if kept]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: benchmarks/device.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed(request):
    # A per-test seed derived from the test id: reproducible, yet different per case.
    import zlib

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
