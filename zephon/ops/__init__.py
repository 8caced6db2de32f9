"""Lane operators: the contract (`base`) and one operator a module."""

from zephon.ops.base import Accumulator, Operator, Step, Transform, run_transforms
from zephon.ops.filter import Filter, FlatMap
from zephon.ops.map import Map, RandomMap
from zephon.ops.mix import PerSource

__all__ = [
           "Accumulator",
           "Filter",
           "FlatMap",
           "Map",
           "Operator",
           "PerSource",
           "RandomMap",
           "Step",
           "Transform",
           "run_transforms",
]
