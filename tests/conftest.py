import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import pytest


@pytest.fixture(scope="session")
def embedded_corpus(tmp_path_factory):
    """The embedded corpus, built once per test session (about 3 s)."""
    from llm_pretrain.data import ensure_embedded_corpus

    return ensure_embedded_corpus(str(tmp_path_factory.mktemp("embedded")))
