"""Fixtures shared by every test directory. Importable helpers (tiny models, datasets, CLI
runners...) live in tests/helpers/.

``DIT_REQUIRE_GPU=1`` (set by ``make gpu-check``) turns the skip of a ``gpu``-marked test into a
failure: on the GPU machine every CUDA-only test must really run.
"""

import os

import pytest
import torch

# Two cores on CI: keep intra-op threads bounded so parallel helpers do not thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (make test: -n 2) each worker already has a core: one intra-op thread, and
    # one OpenMP thread in every process a test launches (CLI runs, gloo ranks, notebook kernels),
    # which inherit this environment; a test that wants more sets it in its child's env.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _in_a_temporary_directory(tmp_path, monkeypatch):
    """Every test runs in its own temporary directory: what a command writes at a relative path (the
    demo config's outputs/demo and data/digits, an --output) never lands in the repository, or in a
    user's outputs/demo beside it (tests/test_first_run.py checks this from a copy of the repository).
    A test that reads the repository's files names them from ``tests.helpers.cli.ROOT``."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def one_thread():
    """One intra-op thread, for modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    their matmuls gain nothing from a second thread, and on a busy 2-core machine the threads'
    spin-waits made steps 5-20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """The bundled digits (1 x 8 x 8 pixels, 10 classes) prepared as a store, once per test module.
    (tests/data/test_datamodule.py overrides ``store`` with a store of random latents.)"""
    from dit_lightning.data import prepare_digits

    return prepare_digits(str(tmp_path_factory.mktemp("digits") / "store"))


REQUIRE_GPU_ENV = "DIT_REQUIRE_GPU"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("gpu") and os.environ.get(REQUIRE_GPU_ENV) == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} is marked gpu but skipped ({reason}) while {REQUIRE_GPU_ENV}=1 requires every CUDA test "
            "to run: run it on a machine where torch.cuda.is_available() (make gpu-check), or unset the variable"
        )
