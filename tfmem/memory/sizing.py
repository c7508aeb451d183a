"""Sizing: what a request weighs at its fed shapes, read from the graph once.

Planning is a pure function of the analysed view; predicting memory needs two
more things that only TensorFlow knows, both fixed by the shapes fed:

    shapes      every tensor's shape, unknown dimensions resolved (`shapes.resolve_shapes`)
    scratch     each kernel's scratch bytes at those shapes (`scratch.calibrate`)
    workspaces  outputs kernels return past the op's own, and the scratch that saves
                their readers (`workspace.measure`: oneDNN's max pooling)
    early       the part of each kernel's scratch it allocates before its outputs
                (`scratch.scratch_before_outputs`: where in the allocator they land)
    signatures  what makes ops equal for Grappler's merge of equal ops (`dedup`)
    regions     how the device's allocator holds memory (`emulated.allocator_regions`:
                its cap, and whether it took the cap as one region)

`Sizing.of` asks the graph for both; `budget.fit` and the out-of-memory
advice then search plans from the view and this value alone, and never touch
the graph again.
"""

import dataclasses

from tfmem.memory import dedup, emulated, workspace
from tfmem.memory.allocator import Regions
from tfmem.memory.shapes import import_request, node_defs, resolve_shapes


@dataclasses.dataclass(frozen=True)
class Sizing:
    """A request's tensor shapes ({tensor: shape or None}) and kernel scratch ({op: bytes}),
    its kernels' workspaces and its ops' dedup signatures (both may be empty)."""
    shapes: dict
    scratch: dict
    workspaces: workspace.Workspaces = dataclasses.field(default_factory=workspace.Workspaces)
    signatures: dict = dataclasses.field(default_factory=dict)
    concurrent_ops: int = 1  # kernels that may run at once (see concurrency)
    regions: Regions = Regions()  # the allocator layout the chunk replay starts from
    early_scratch: dict = dataclasses.field(default_factory=dict)  # {op: bytes before outputs}

    @classmethod
    def of(cls, graph, view, feed_shapes, session=None, concurrent_ops=1):
        """The sizing of the request `view` of `graph` at `feed_shapes` ({fed tensor name:
        shape}); kernel scratch measured under `session`'s threads (see scratch);
        `concurrent_ops`: how many kernels the device may run at once."""
        # Both read shapes inferred at the fed shapes from one copy of the request, and the
        # copy and the signatures read each op's NodeDef serialized once.
        serialized = node_defs(graph, view)
        copy = import_request(graph, view, feed_shapes, serialized) if feed_shapes else None
        scratch, workspaces, early = workspace.measure(graph, view, feed_shapes, session,
                                                       scratch_graph=copy)
        return cls(resolve_shapes(graph, view, feed_shapes, copy), scratch, workspaces,
                   dedup.signatures(graph, view, session, serialized), concurrent_ops,
                   emulated.allocator_regions(), early)

    def simulate_options(self):
        """The keyword arguments of `simulate` this sizing fixes besides shapes and scratch."""
        return dict(workspaces=self.workspaces, signatures=self.signatures,
                    concurrent_ops=self.concurrent_ops, regions=self.regions,
                    early_scratch=self.early_scratch)
