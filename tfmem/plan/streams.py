"""Streams: which random streams a plan draws from, and a guard against a second one.

A stateful random op keeps its stream in its kernel, one kernel per op name
and session.  A plan that runs the user's op (an *original*, see `analyse`)
draws from that stream, as plain `Session.run` does.  A plan that runs a
*copy* of it (imported under the plan's scope) would draw from a stream of
the copy's own, which starts again from the op's seed.

Every random op of a request runs as the user's op, with what running
it runs too (see `analyse._run_together`):

* one with a control input of its own (`tf.control_dependencies([update])`
  around the random op) runs with the ops its control edges reach, as the
  user's ops, in one call: `update` runs there once, as in plain TensorFlow;
* one inside a v1 while loop runs with its whole outermost loop frame as
  the user's ops (`loop_frames`), the inputs of the loop's Enters connected.

The `StreamLedger` of a session stays as a guard: should a seeded random op
ever run as a copy, a second plan drawing from it would silently give other
numbers, so the ledger refuses it, naming the op.  Unseeded ops are exempt:
each kernel gets a fresh random seed, so copies never repeat each other's
numbers, and no seeded run exists to compare with.
"""

from tfmem.plan import optypes
from tfmem.errors import UnsupportedGraphError

_MAY_DRAW = optypes.RANDOM_STREAM | optypes.STATEFUL_CALLS


def loop_frames(nodes):
    """Op name -> frame name of the outermost v1 while loop it belongs to, for the view's
    nodes inside one (its Enters, body, Merges, Switches, NextIterations and Exits).

    Works on graphs imported from a GraphDef too (no Python loop contexts).  A
    pass in producer-first order: an Enter opens a frame, an Exit closes one,
    every other op is as deep as its deepest producer; NextIteration back
    edges are not followed.  An op keeps the frame name of the Enter that
    opened its outermost frame; an Exit belongs to the frame it closes.
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
                raise UnsupportedGraphError(
                    f"Random op '{name}' ({op.type}) would draw from a second stream: tfmem "
                    f"runs it as a copy (tfmem could not run your op with what it needs in "
                    f"one call), and a copy's stream starts again from the seed, so this "
                    f"request (another plan than {earlier[0]}, which already drew from it) "
                    f"would not give plain TensorFlow's numbers. To change: draw from this op "
                    "through one request (the same fetches and feeds) of this TFMemSession "
                    "only, and report the graph to tfmem.")
            claims[name] = (scope, how)
        for name, claim in claims.items():
            self._drawn.setdefault(name, claim)
