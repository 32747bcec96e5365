"""Fixtures of the trainer tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models are all thread-synchronisation overhead: on a shared 2-core machine two intra-op
    # threads measured ~40x slower per step than one.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
