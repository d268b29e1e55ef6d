"""Goodput: what fault tolerance is worth, per failure and per month.

``model`` holds the inputs and the closed-form model (standard library only),
``simulate`` the Monte Carlo check of it (numpy), ``presets`` the named
published scenarios, ``measured`` the reader of torchpass's own benchmark
results, ``plot`` the optional matplotlib chart. docs/goodput.md explains it.
"""

from torchpass.goodput.model import (
    GoodputInputs,
    ModelResult,
    StrategyResult,
    build_inputs,
    evaluate,
)

__all__ = ["GoodputInputs", "ModelResult", "StrategyResult", "build_inputs", "evaluate"]
