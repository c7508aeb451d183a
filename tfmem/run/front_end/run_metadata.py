"""The RunMetadata of a partitioned step: what `Session.run` would return for the whole step.

A step is several session calls, each with its own RunMetadata; the user asked
for one.  `StepMetadata` collects the calls' and merges them the way a user of
plain `Session.run` reads them:

* `step_stats`: only when the user asked for a trace (`trace_level` above
  NO_TRACE), or the step built a cost model (as plain TensorFlow fills it on
  such steps).  tfmem traces the steps it measures to read their peaks (see
  sampling); those statistics are its own and never reach the user.  One
  DeviceStepStats per device, holding every call's node statistics in the
  order the calls ran (nodes keep the names they ran under: a copy of the
  user's op is `<scope>/p<partition>/<op>`, tfmem's own ops `<scope>/p<i>_in/`
  and `_out/`).
* `partition_graphs` (`RunOptions.output_partition_graphs`): one GraphDef per
  device, the union of the graphs the calls ran there; a node several calls
  ran (a variable's handle, a fed placeholder's argument) appears once.
  Names as in `step_stats`, so a graph's edges stay whole.
* `cost_graph` (`GraphOptions.build_cost_model`): the calls' cost graphs as
  one, each node named after the user's op it copies, nodes of one name and
  device merged into the first, ids renumbered to stay unique.
* anything else the calls return, merged as protobuf merges.
"""

import re

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2

# The name scope of a partition's copy of a user's op (rewrite.copy_partitions)
_COPY_SCOPE = re.compile(r"tfmem/plan(?:_\d+)?/p\d+/")


def user_name(name):
    """The user's op a node copies (`<scope>/p<i>/<op>` -> `<op>`), else `name`."""
    return _COPY_SCOPE.sub("", name)


def _traced(options):
    return options is not None and options.trace_level > config_pb2.RunOptions.NO_TRACE


class StepMetadata:
    """Collects the RunMetadata of one step's calls (`add`); `merged()` is the user's."""

    def __init__(self, options):
        self._traced = _traced(options)
        self._calls = []

    def add(self, metadata):
        """The RunMetadata one call of the step returned."""
        self._calls.append(metadata)

    def merged(self):
        """One RunMetadata for the step (see the module docstring)."""
        out = config_pb2.RunMetadata()
        rest = config_pb2.RunMetadata()
        for call in self._calls:
            other = config_pb2.RunMetadata()
            other.CopyFrom(call)
            for field in ("step_stats", "partition_graphs", "cost_graph"):
                other.ClearField(field)
            rest.MergeFrom(other)
        out.MergeFrom(rest)
        cost_graphs = [c.cost_graph for c in self._calls if c.HasField("cost_graph")]
        if self._traced or cost_graphs:
            out.step_stats.CopyFrom(merge_step_stats(c.step_stats for c in self._calls))
        if cost_graphs:
            out.cost_graph.CopyFrom(merge_cost_graphs(cost_graphs))
        out.partition_graphs.extend(
            merge_partition_graphs(g for c in self._calls for g in c.partition_graphs))
        return out


def merge_step_stats(step_stats):
    """One StepStats with one DeviceStepStats per device, in order of first appearance."""
    out = config_pb2.RunMetadata().step_stats
    by_device = {}
    for stats in step_stats:
        for device in stats.dev_stats:
            merged = by_device.get(device.device)
            if merged is None:
                merged = by_device[device.device] = out.dev_stats.add(device=device.device)
            merged.node_stats.extend(device.node_stats)
            merged.thread_names.update(device.thread_names)
    return out


def _device_of(graph_def):
    return next((node.device for node in graph_def.node if node.device), "")


def merge_partition_graphs(graph_defs):
    """One GraphDef per device: the union of the graphs (by node name), in order of the
    devices' first appearance."""
    merged = {}
    names = {}
    functions = {}
    for graph_def in graph_defs:
        device = _device_of(graph_def)
        if device not in merged:
            merged[device] = graph_pb2.GraphDef(versions=graph_def.versions)
            names[device], functions[device] = set(), set()
        out = merged[device]
        for node in graph_def.node:
            if node.name not in names[device]:
                names[device].add(node.name)
                out.node.add().CopyFrom(node)
        for function in graph_def.library.function:
            if function.signature.name not in functions[device]:
                functions[device].add(function.signature.name)
                out.library.function.add().CopyFrom(function)
    return list(merged.values())


def merge_cost_graphs(cost_graphs):
    """One CostGraphDef of several: nodes named after the user's ops, a node of a name and
    device already present merged into it, ids renumbered and edges following them."""
    out = config_pb2.RunMetadata().cost_graph
    first = {}  # (name, device) -> id in `out`
    next_id = 0
    for graph in cost_graphs:
        ids = {}  # id in `graph` -> id in `out`
        added = []
        for node in graph.node:
            key = (user_name(node.name), node.device)
            if key in first:
                ids[node.id] = first[key]
                continue
            copy = out.node.add()
            copy.CopyFrom(node)
            copy.name, copy.id = key[0], next_id
            ids[node.id] = first[key] = next_id
            next_id += 1
            added.append(copy)
        for node in added:
            for edge in node.input_info:
                edge.preceding_node = ids.get(edge.preceding_node, edge.preceding_node)
            node.control_input[:] = [ids.get(i, i) for i in node.control_input]
        out.cost.extend(graph.cost)
    return out
