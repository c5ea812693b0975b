"""pytest setup: the `gpu` mark, skipped cleanly on a machine without a CUDA device, and the
`distributed` mark of tests that launch several processes with torchrun."""

import os

import pytest
import torch

# The CPU tests step CPU models on the simulated device, on a machine with a GPU too (where a CPU
# model is otherwise refused: strata.optim.AdamW's device argument).
os.environ.setdefault("STRATA_DEVICE", "simulated")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "distributed: launches 2 processes with torchrun (gloo)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
