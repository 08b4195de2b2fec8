"""Shared helpers for unit tests."""

import csv
from pathlib import Path

import pytest

# TRITON_INTERPRET (Triton's CPU interpreter, without CUDA) is set in tests/conftest.py.

REFERENCE = Path(__file__).resolve().parents[1] / "reference"


def read_reference(name: str) -> list[dict[str, str]]:
    """Rows of tests/reference/<name> (paper tables copied from /work/shared/reference)."""
    with open(REFERENCE / name) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@pytest.fixture
def reference():
    return read_reference
