"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    Tiny models step fastest on one thread; on a shared 2-core machine OpenMP's spinning makes small ops (a 64 x 90
    SVD) up to 100x slower with two. The previous count is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(corpus, cache): the first KJV chapters as a local .txt file and a cache folder, once per test module (the
    pretraining, comparison and checkpoint tests' small real corpus: pretrain_helpers.write_corpus)."""
    from pretrain_helpers import write_corpus
    folder = tmp_path_factory.mktemp("corpus")
    return write_corpus(folder), folder / "cache"
