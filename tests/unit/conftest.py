"""Shared helpers for unit tests."""

import csv
import os
from pathlib import Path

import pytest
import torch

# The `triton` attention backend runs on CPU only under Triton's interpreter, whose mode is
# fixed when triton is first imported: switch it on before any test imports triton. On a CUDA
# machine the kernels run natively (tests/gpu) and the interpreted unit tests skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REFERENCE = Path(__file__).resolve().parents[1] / "reference"


def read_reference(name: str) -> list[dict[str, str]]:
    """Rows of tests/reference/<name> (paper tables copied from /work/shared/reference)."""
    with open(REFERENCE / name) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@pytest.fixture
def reference():
    return read_reference
