"""Dedup: the equal ops Grappler merges before a partition runs.

TensorFlow's graph optimizer (its CSE), and Grappler's common subgraph elimination
and arithmetic optimizer (all on by default, in every Session callable and every
`tf.function`) keep one of several ops that compute the
same thing: same op type, device, attributes and inputs (commutative ops'
inputs in any order), free of side effects.  The other copies never run, and
their outputs are the kept op's buffers.  An unrolled bidirectional RNN slices
its input `x[:, t, :]` once per direction and time step: the two directions'
slices of one step are equal, so TensorFlow holds 16 slices where the graph
has 32 (1 MiB of the test RNN's 6.4 MiB peak, which the simulator
over-predicted by 10-13 % in one partition before it merged them too).

It merges only what one callable runs: ops of different partitions stay apart.

    signatures(graph, view, session)   {op: what makes it equal}, from the graph once
    duplicates(view, order, signatures, keep)
                                       {op: the earlier equal op of the same partition}
    Duplicates(view, order, signatures, keep).in_order(other_order)
                                       the same for another order of the partition's ops

Constants count as equal by value (Grappler merges equal Const nodes first, and
their readers become equal through them).
"""

from tensorflow.core.framework.node_def_pb2 import NodeDef
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from tfmem import tf_private
from tfmem.memory import shapes
from tfmem.plan.analyse import split_tensor_name
from tfmem.plan import optypes

# Ops whose result does not depend on their inputs' order (Grappler sorts their inputs).
COMMUTATIVE = frozenset({"Add", "AddV2", "AddN", "Mul", "Maximum", "Minimum", "Equal",
                         "NotEqual", "LogicalAnd", "LogicalOr", "SquaredDifference"})
# Never merged: loop frame edges (Grappler skips Enter and Exit) and what a step feeds.
_NEVER = optypes.CONTROL_FLOW | optypes.FEEDABLE_PLACEHOLDERS


def merges_equal_ops(session):
    """Whether TensorFlow merges equal ops in `session`'s callables.  Three passes do:
    the classic graph optimizer's CSE (at its default level, L1), Grappler's common
    subgraph elimination and its arithmetic optimizer (measured: with any one of them
    on, two equal transposes run as one).  On unless the session's config turns all
    three off."""
    config = tf_private.config_of(session)
    if config is None:
        return True
    classic = config.graph_options.optimizer_options
    if classic.opt_level != config_pb2.OptimizerOptions.L0 or \
            classic.do_common_subexpression_elimination:
        return True
    rewrite = config.graph_options.rewrite_options
    off = rewriter_config_pb2.RewriterConfig.OFF
    return not (rewrite.disable_meta_optimizer or (
        rewrite.common_subgraph_elimination == off and rewrite.arithmetic_optimization == off))


def signatures(graph, view, session=None, node_defs=None):
    """{op name: hashable signature} of the request's ops Grappler may merge, and of its
    constants (by value).  Empty when the session turns the merge off.  `node_defs`:
    `shapes.node_defs(graph, view)`, when the caller has them."""
    if not merges_equal_ops(session):
        return {}
    if node_defs is None:
        node_defs = shapes.node_defs(graph, view)
    found, memo = {}, {}
    for name, node in list(view.nodes.items()) + list(view.sources.items()):
        if node.type != "Const" and (name in view.sources or node.stateful
                                     or node.side_effects or node.type in _NEVER
                                     or name in view.originals):
            continue
        if name not in node_defs:
            continue
        attrs = node_attrs(node_defs[name], memo)
        found[name] = (node.type, node.device, tuple(a for a in attrs if a[0] != "_class"))
    return found


def node_attrs(serialized, memo):
    """((name, value serialized deterministically), ...) of the attributes of the NodeDef
    `serialized`, sorted by name.  `memo` ({}: one per request) holds them per distinct
    NodeDef left without its name and inputs: the ops of a deep model repeat a few
    attribute sets, and serialising each op's attributes again costs more than the
    lookup."""
    node = NodeDef.FromString(serialized)
    node.ClearField("name")
    node.ClearField("input")
    rest = node.SerializeToString(deterministic=True)
    attrs = memo.get(rest)
    if attrs is None:
        attrs = memo[rest] = tuple(sorted(
            (key, value.SerializeToString(deterministic=True))
            for key, value in node.attr.items()))
    return attrs


class EqualityFacts:
    """What `duplicates` reads of each op of a view, whatever partition it is in and
    whatever order its ops run in: a budget search simulates several orders of many
    partitions of one view.  Found for an op when first asked for."""

    def __init__(self, view, signatures):
        self._view = view
        self._signatures = signatures
        self._ops = {}
        # constant -> its signature (its value): readers of equal constants are equal
        self.constants = {name: signatures[name] for name, node in view.sources.items()
                          if node.type == "Const" and name in signatures}

    def of(self, name):
        """(signature, input ops, input indices, commutative, control inputs compared as
        they are, mergeable ones) of op `name`, or None for an op never merged."""
        try:
            return self._ops[name]
        except KeyError:
            pass
        signature = self._signatures.get(name)
        facts = None
        if signature is not None:
            node = self._view.nodes[name]
            controls = frozenset(node.control_inputs)
            mergeable = controls - controls.difference(self._signatures)
            facts = (signature, node.input_ops, node.input_indices, node.type in COMMUTATIVE,
                     controls - mergeable if mergeable else controls, tuple(mergeable))
        self._ops[name] = facts
        return facts


_UNKNOWN = object()  # an op `EqualityFacts` has not been asked about yet


def duplicates(view, order, signatures, keep=(), facts=None):
    """{op name: the equal op it is merged into}: see `_duplicates`; a `Duplicates`
    finds the same for several orders of one partition's ops at the cost of one."""
    return _duplicates(view, order, signatures, keep, facts)[0]


class Duplicates:
    """The equal ops of one partition, found once for every dependency order of its ops.

    Which ops are equal does not depend on the order they are met in: an op's inputs
    stand for the op kept in their place, one per set of equal ops, whichever that is.
    Only which op of a set is kept does: the first in the order.  So the sets found in
    one order serve every other.  Except where a fetched op (never merged away) is equal
    to another: met second, it stays apart and its readers differ from the first's
    readers.  An order that meets a fetched op after an op equal to it is therefore
    merged again on its own."""

    def __init__(self, view, order, signatures, keep=(), facts=None):
        self._view, self._signatures, self._keep, self._facts = view, signatures, keep, facts
        self.first, equal_sets = _duplicates(view, order, signatures, keep, facts)
        self._sets = None if equal_sets is None else list(equal_sets.values())
        fetched = {split_tensor_name(t)[0] for t in keep}
        # sets whose fetched op must come first for the sets to hold
        self._led = [members for members in self._sets or () if members[0] in fetched]

    def in_order(self, order):
        """{op name: the equal op it is merged into} when the partition's ops run in
        `order` (another dependency order of the same ops)."""
        if self._sets is None:
            return _duplicates(self._view, order, self._signatures, self._keep,
                               self._facts)[0]
        if not self._sets:
            return {}
        position = {name: step for step, name in enumerate(order)}
        if any(min(members, key=position.__getitem__) != members[0] for members in self._led):
            return _duplicates(self._view, order, self._signatures, self._keep,
                               self._facts)[0]
        merged = {}
        for members in self._sets:
            kept = min(members, key=position.__getitem__)
            for name in members:
                if name != kept:
                    merged[name] = kept
        return merged


def _duplicates(view, order, signatures, keep=(), facts=None):
    """({op name: the equal op it is merged into}, {kept op: the ops equal to it, itself
    first} or None where a fetched op is equal to an earlier one), among the ops of one
    partition in `order` (dependency order: the first of equal ops is the one kept).
    Ops with an output in `keep` (fetched: Grappler preserves fetch nodes) are never
    merged away.  `facts`: the view's `EqualityFacts` for `signatures`, when the caller
    has them."""
    if not signatures:
        return {}, {}
    facts = facts or EqualityFacts(view, signatures)
    facts_of, constants = facts.of, facts.constants
    merged, seen = {}, {}
    by_value = {}  # a constant's signature -> the first constant of that value read here

    def standing_for(op):
        """The op an input stands for: the op kept in its place, or for a constant the
        first equal constant the partition reads."""
        kept = merged.get(op)
        if kept is not None:
            return kept
        value = constants.get(op)
        return op if value is None else by_value.setdefault(value, op)

    kept_ops = {split_tensor_name(t)[0] for t in keep}
    equal_sets = {}
    found = facts._ops  # facts_of's cache, read inline: the loop runs per op of every order
    for name in order:
        known = found.get(name, _UNKNOWN)
        if known is _UNKNOWN:
            known = facts_of(name)
        if known is None:
            continue
        signature, input_ops, input_indices, commutative, controls, mergeable = known
        inputs = []
        for op, index in zip(input_ops, input_indices):  # standing_for, inlined: the hot loop
            stands = merged.get(op)
            if stands is None:
                value = constants.get(op)
                stands = op if value is None else by_value.setdefault(value, op)
            inputs.append((stands, index))
        if commutative:
            inputs.sort()
        # Control inputs Grappler cannot merge stand for themselves, compared as a set in
        # C (a training step's gradients wait for hundreds of updates); the others stand
        # for the op kept in their place.
        if mergeable:
            controls = (controls, tuple(sorted({standing_for(c) for c in mergeable})))
        key = (signature, tuple(inputs), controls)
        first = seen.setdefault(key, name)
        if first != name:
            if name in kept_ops:
                equal_sets = None
            elif equal_sets is not None:
                equal_sets.setdefault(first, [first]).append(name)
            if name not in kept_ops:
                merged[name] = first
    return merged, equal_sets
