import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels (fulmen.unsloth) run under Triton's CPU interpreter: it is chosen when triton is
# imported, so before any test imports it.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Lines the oracles report (their counts), printed at the end of the run; with pytest-xdist each worker hands its
# lines to the controller, which prints them all.
SUMMARY = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def summary(request):
    """`summary(line)`: adds a line to the report printed after the tests."""
    return request.config.stash.setdefault(SUMMARY, []).append


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fulmen_summary"] = session.config.stash.get(SUMMARY, [])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    node.config.stash.setdefault(SUMMARY, []).extend(getattr(node, "workeroutput", {}).get("fulmen_summary", []))


def pytest_terminal_summary(terminalreporter):
    for line in terminalreporter.config.stash.get(SUMMARY, []):
        terminalreporter.write_line(line)


def pytest_addoption(parser):
    parser.addoption("--hf-all", action="store_true", default=False,
                     help="tests/models/test_hf.py: run every transformers family through the Dynamo backend too")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device machine with -m cuda)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _distributions_validate():
    # Dynamo's first use in a process turns torch.distributions' default argument validation off for good
    # (TorchPatcher.patch): each test starts from a fresh process's default, whichever tests ran before it
    torch.distributions.Distribution.set_default_validate_args(True)


@pytest.fixture(scope="module", autouse=True)
def _rank_pools():
    # the launches of one module share warm rank processes (tests/distributed/launch.py); ended with the module, so
    # which launches share processes does not depend on how pytest-xdist hands out the files
    yield
    launch = sys.modules.get("tests.distributed.launch")
    if launch is not None:
        launch.close_pools()
