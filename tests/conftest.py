import pytest
import safeattn  # noqa: F401  registers torch.ops.safeattn.*
import torch

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
