"""Shared fixtures."""

from __future__ import annotations

import pytest
from torch import nn

from .builders import trained_small_model


@pytest.fixture
def small_vit() -> nn.Module:
    return trained_small_model("vit", "un")
