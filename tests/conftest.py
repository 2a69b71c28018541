import os
import sys

# The tests import this copy of the repository, whether or not (and whichever copy) the package is
# installed: first on sys.path here, and first on PYTHONPATH for every process the tests start
# (scripts, run_pretrain.py, workers; tests/launch_utils.py adds tests/ for the launched workers).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
# Under pytest-xdist two launches run at once. Paddle's launcher takes its store's and ranks' ports from a random
# point of PORT_RANGE (default 35100:64000, paddle/distributed/launch/context/node.py), which overlaps the
# kernel's ephemeral ports (32768-60999) that every gloo connection takes: two jobs met on one port (SIGABRT in
# the store's LibUVMasterDaemon, SIGSEGV in a rank). Each worker gets its own range below the ephemeral ones.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and "PORT_RANGE" not in os.environ:
    _first = 20000 + 4000 * (int(_WORKER[2:]) % 3)
    os.environ["PORT_RANGE"] = f"{_first}:{_first + 3999}"

import pytest

# In-process tests on GPU run with the environment launched ones get (no TF32, deterministic kernels).
sys.path.insert(1, os.path.join(REPO_ROOT, "tests"))
from launch_utils import use_test_device_in_this_process  # noqa: E402

use_test_device_in_this_process()


@pytest.fixture(scope="session")
def embedded_corpus(tmp_path_factory):
    """The embedded corpus, built once per test session (about 3 s): under xdist one directory for both workers
    (ensure_embedded_corpus renames a finished build into place), so the argument files either worker writes for a
    shared launch are the same."""
    from llm_pretrain.data import ensure_embedded_corpus

    if os.environ.get("PYTEST_XDIST_WORKER"):
        from shared_launches import locked

        session = tmp_path_factory.getbasetemp().parent
        with locked(session / "embedded.lock"):  # the second worker waits and finds it built
            return ensure_embedded_corpus(str(session / "embedded"))
    return ensure_embedded_corpus(str(tmp_path_factory.mktemp("embedded")))


@pytest.fixture(scope="session")
def shared_launches(tmp_path_factory, embedded_corpus):
    """One launch per fleet layout for the session's test files (tests/shared_launches.py), shared by the
    xdist workers: each launch runs once, on the worker that asks first."""
    from shared_launches import SharedLaunches, session_root

    return SharedLaunches(session_root(tmp_path_factory), embedded_corpus)


# The files that keep a worker longest (their own launches; measured in a full run), handed out first so that the
# two workers end together: xdist gives a worker the next file when it is free, and a long file handed out last
# kept one worker busy 6.7 minutes after the other had finished (1,957 s against about 1,750 balanced).
LONGEST_FIRST = ("test_long_context", "test_real_size", "test_documents", "test_planner", "test_elastic",
                 "test_expert_parallel", "test_parallel_parity", "test_resilience", "test_uneven_pipeline",
                 "test_fault_injection", "test_gqa_replication", "test_resume_any_layout")


def pytest_configure(config):
    # xdist orders the files by their number of tests unless told not to (xdist/scheduler/loadscope.py schedule,
    # `loadscopereorder`): many small tests are not long, so the order of LONGEST_FIRST is kept instead
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command), a test file runs whole on one worker:
    its module-scoped fixtures train once. The shared launches are shared by the workers (each runs once,
    tests/shared_launches.py), so the files asking for them spread over both. Without xdist the marks do nothing.
    The longest files come first (LONGEST_FIRST), each file's tests in their own order."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    rank = {name: at for at, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # (stable: the rest as collected)
