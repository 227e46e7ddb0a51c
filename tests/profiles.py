"""Calibration profiles for tests: known parameters wrapped in placeholder metadata."""

from __future__ import annotations

from typing import Any

from sim.config.calibration import CalibrationProfile
from sim.cost_model import CostParams


def profile_with(params: CostParams, **fields: Any) -> CalibrationProfile:
    """A profile carrying ``params``; ``fields`` override the placeholder metadata."""
    metadata: dict[str, Any] = dict(
        hardware="h", model="m", vllm_version="v", fit={}, num_steps=0, created_by="test"
    )
    return CalibrationProfile(params=params, **{**metadata, **fields})
