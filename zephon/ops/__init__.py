"""Lane operators: the contract (`base`) and one operator a module."""

from typing import Any

from zephon.errors import deprecated_attribute
from zephon.ops.base import DEPRECATED, Accumulator, AccumulatorStep, Operator, Transform, run_transforms
from zephon.ops.filter import Filter, FlatMap
from zephon.ops.map import Map, RandomMap
from zephon.ops.mix import PerSource

__all__ = [
           "Accumulator",
           "AccumulatorStep",
           "Filter",
           "FlatMap",
           "Map",
           "Operator",
           "PerSource",
           "RandomMap",
           "Transform",
           "run_transforms",
]


def __getattr__(name: str) -> Any:  # zephon.ops.Step: deprecated for one version
    return deprecated_attribute(__name__, name, DEPRECATED)
