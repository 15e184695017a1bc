"""Test-wide setup.

Triton kernels run under the interpreter on machines without a CUDA GPU; the switch must be set
before the first `import triton`, so it lives here, at the very top of the test session.
"""
import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Every test draws fresh random inputs, but reproducibly from its own name."""
    torch.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
