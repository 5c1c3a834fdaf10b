"""Everything in tests/gpu/ needs CUDA: marked ``gpu`` and skipped, with the reason, where none is present."""
import pytest
import torch

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False); run on a GPU machine: python -m pytest tests/gpu -m gpu"


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))
