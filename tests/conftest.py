import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_cuda_process_state():
    """Scripts run in-process by GPU tests cap this process's GPU memory
    (``set_per_process_memory_fraction``); the cap would follow into every later test."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(1.0, index)
        torch.cuda.empty_cache()
