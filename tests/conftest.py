"""Shared test set-up: everything runs offline, on CPU, deterministically."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels then run on CPU tensors in Triton's interpreter (read at its import)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
