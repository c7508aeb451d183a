"""Sizing: what a request weighs at its fed shapes, read from the graph once.

Planning is a pure function of the analysed view; predicting memory needs two
more things that only TensorFlow knows, both fixed by the shapes fed:

    shapes   every tensor's shape, unknown dimensions resolved (`shapes.resolve_shapes`)
    scratch  each kernel's scratch bytes at those shapes (`scratch.calibrate`)

`Sizing.of` asks the graph for both; `budget.fit` and the out-of-memory
advice then search plans from the view and this value alone, and never touch
the graph again.
"""

import dataclasses

from tfmem.memory.scratch import calibrate
from tfmem.memory.shapes import resolve_shapes


@dataclasses.dataclass(frozen=True)
class Sizing:
    """A request's tensor shapes ({tensor: shape or None}) and kernel scratch ({op: bytes})."""
    shapes: dict
    scratch: dict

    @classmethod
    def of(cls, graph, view, feed_shapes, session=None):
        """The sizing of the request `view` of `graph` at `feed_shapes` ({fed tensor name:
        shape}); kernel scratch measured under `session`'s threads (see scratch)."""
        return cls(resolve_shapes(graph, view, feed_shapes),
                   calibrate(graph, view, feed_shapes, session))
