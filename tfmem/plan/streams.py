"""Streams: which random streams a plan draws from, and a guard against a second one.

A stateful random op keeps its stream in its kernel, one kernel per op name
and session.  A plan that runs the user's op (an *original*, see `analyse`)
draws from that stream, as plain `Session.run` does.  A plan that runs a
*copy* of it (imported under the plan's scope) draws from a stream of the
copy's own, which starts again from the op's seed.  Two random ops stay
copies:

* one with a control input of its own (`tf.control_dependencies([update])`
  around the random op): running the user's op would run `update` again,
  and a control edge cannot be cut the way a connected data edge is;
* one inside a v1 while loop (`Enter ... Exit` frame): its per-iteration
  inputs cannot be connected from a copy of the loop (TensorFlow refuses the
  connection, and Python refuses the copies reading an op inside a loop).

One plan that copies such an op still draws plain TensorFlow's numbers: its
copy is the only stream.  A second plan drawing from the same op would start
the stream again (or continue the user's op where the copy left off) and
silently give other numbers, so the `StreamLedger` of a session refuses it,
naming the op and what to change.  Unseeded ops are exempt: each kernel gets
a fresh random seed, so copies never repeat each other's numbers, and no
seeded run exists to compare with.
"""

from tensorflow.python.ops import control_flow_util

from tfmem.plan import optypes
from tfmem.errors import UnsupportedGraphError

_MAY_DRAW = optypes.RANDOM_STREAM | optypes.STATEFUL_CALLS


def in_v1_loop(op):
    """True for an op inside a v1 while loop (a graph built in Python with control flow v1).

    Graphs imported from a GraphDef carry no loop context; their loop bodies
    are found from the view (see `loop_bodies`).
    """
    return control_flow_util.GetWhileContext(op) is not None


def loop_bodies(nodes):
    """Names of the view's nodes inside a v1 while frame (between an Enter and its Exit).

    A pass in producer-first order: an Enter opens a frame, an Exit closes
    one, every other op is as deep as its deepest producer; NextIteration
    back edges are not followed.
    """
    consumers = {name: [] for name in nodes}
    indegree = dict.fromkeys(nodes, 0)
    for name, node in nodes.items():
        producers = [t.rpartition(":")[0] for t in node.inputs] + list(node.control_inputs)
        for src in dict.fromkeys(p for p in producers if p in nodes):
            if nodes[src].type in optypes.NEXT_ITERATION:
                continue
            indegree[name] += 1
            consumers[src].append(name)
    depth = dict.fromkeys(nodes, 0)
    ready = [name for name, count in indegree.items() if count == 0]
    while ready:
        name = ready.pop()
        node = nodes[name]
        if node.type in optypes.ENTER:
            depth[name] += 1
        elif node.type in optypes.EXIT:
            depth[name] = max(depth[name] - 1, 0)
        for reader in consumers[name]:
            depth[reader] = max(depth[reader], depth[name])
            indegree[reader] -= 1
            if indegree[reader] == 0:
                ready.append(reader)
    return {name for name, d in depth.items() if d > 0 and nodes[name].type not in optypes.EXIT}


def loop_frames(nodes):
    """Op name -> frame name of the outermost v1 while loop it belongs to, for the view's
    nodes inside one (its Enters, body, Merges, Switches, NextIterations and Exits).

    The same pass as `loop_bodies`, carrying the name of the Enter that opened
    the outermost frame; an Exit belongs to the frame it closes.
    """
    consumers = {name: [] for name in nodes}
    indegree = dict.fromkeys(nodes, 0)
    for name, node in nodes.items():
        producers = [t.rpartition(":")[0] for t in node.inputs] + list(node.control_inputs)
        for src in dict.fromkeys(p for p in producers if p in nodes):
            if nodes[src].type in optypes.NEXT_ITERATION:
                continue
            indegree[name] += 1
            consumers[src].append(name)
    depth, frame_of = dict.fromkeys(nodes, 0), {}
    ready = [name for name, count in indegree.items() if count == 0]
    while ready:
        name = ready.pop()
        node = nodes[name]
        if node.type in optypes.ENTER:
            if depth[name] == 0:
                frame_of[name] = node.frame
            depth[name] += 1
        elif node.type in optypes.EXIT:
            depth[name] = max(depth[name] - 1, 0)
        for reader in consumers[name]:
            if depth[name] > 0:
                depth[reader] = max(depth[reader], depth[name])
                frame_of.setdefault(reader, frame_of[name])
            indegree[reader] -= 1
            if indegree[reader] == 0:
                ready.append(reader)
    return frame_of


def _seeded(op):
    """True when the op's numbers are fixed by a seed (graph or op level)."""
    if op.type not in optypes.RANDOM_STREAM:
        return True  # a call whose body draws: its seeds are inside, assume set
    attrs = {a.name for a in op.op_def.attr}
    return any(op.get_attr(a) for a in ("seed", "seed2") if a in attrs)


def _why_copied(op, view):
    """(why the op runs as a copy, what the user can change) for the refusal."""
    if in_v1_loop(op) or op.name in loop_bodies(view.nodes):
        return ("it is inside a v1 while loop, whose per-iteration inputs cannot be "
                "connected to your op", "build the loop with control flow v2 "
                "(tf.compat.v1.enable_control_flow_v2() before building the graph)")
    if op.control_inputs:
        names = ", ".join(c.name for c in op.control_inputs)
        return (f"it has control inputs of its own ({names}), which running your op in a "
                "partition would run a second time", "put the control dependency on an op "
                "that reads the random op's output (e.g. tf.identity) instead of on the "
                "random op itself")
    return "tfmem cannot run your op in a partition", "simplify the ops around it"


class StreamLedger:
    """Per session: which plan draws from each seeded random op (see the module docstring)."""

    def __init__(self):
        self._drawn = {}  # op name -> (plan scope, "copy" | "original")

    def claim(self, graph, plan, scope):
        """Record the random streams the plan `scope` draws; raise before anything is
        added to the graph if one would be a second stream of a seeded op."""
        claims = {}
        for name, node in plan.view.nodes.items():
            if node.type not in _MAY_DRAW:
                continue
            op = graph.get_operation_by_name(name)
            if not optypes.draws_random_stream(op) or not _seeded(op):
                continue
            how = "original" if name in plan.view.originals else "copy"
            earlier = self._drawn.get(name)
            if earlier is not None and "copy" in (how, earlier[1]):
                why, change = _why_copied(op, plan.view)
                raise UnsupportedGraphError(
                    f"Random op '{name}' ({op.type}) would draw from a second stream: tfmem "
                    f"runs it as a copy ({why}), and a copy's stream starts again from the "
                    f"seed, so this request (another plan than {earlier[0]}, which already "
                    f"drew from it) would not give plain TensorFlow's numbers. To change: "
                    f"{change}; or draw from this op through one request (the same fetches "
                    "and feeds) of this TFMemSession only.")
            claims[name] = (scope, how)
        for name, claim in claims.items():
            self._drawn.setdefault(name, claim)
