"""Units: groups of ops that must run in the same partition.

A partition boundary is a `Session.run` boundary, and some things do not
survive one.  Seven rules join ops into one unit:

1. *Run-bound edges.*  A resource handle or reference tensor made by a copied
   op (a TensorArray, a v1 loop's stack, a temporary variable) dies with the
   run that made it: producer and consumer stay together.
2. *v1 while frames.*  Enter ... NextIteration ... Exit execute inside one
   executor frame; every op of an outermost frame, nested frames included,
   is one unit.
3. *v1 cond regions.*  A Switch sends a dead tensor down the branch not
   taken; only the Merge that joins both branches of the same predicate
   revives it.  An op is *guarded* by the predicates it may be dead under;
   every guarded op joins the Switches and Merges of its predicates:

        pred --+
        x -- Switch --:1--> Add --+
                 \\                 Merge --> (unguarded again)
                  +-:0--> Mul ----+

4. *Originals run together.*  The user's op (an original, see `analyse`)
   runs the ops its control edges reach in the same call, so an original
   and the originals it has control edges from are one unit.

5. *Regrouped arithmetic.*  Grappler's arithmetic optimizer rewrites a
   tree of sums (or a chain of products) whose inner results have one
   consumer into one AddN (or a reordered chain), sorts the AddN's inputs
   by their producers' names, and hoists a common factor out of a sum of
   products.  Each changes the float result in the last bits, and each
   happens only where the whole pattern is in one function: a partition
   boundary inside a tree, or a producer that becomes an argument named
   otherwise, makes a partition add in another order than plain
   TensorFlow.  So a tree joins into one unit, and a tree of three or more
   leaves (or a sum of products or quotients) joins the leaves' producers
   too (two leaves need nothing: a + b == b + a exactly), unless one leaf's
   producer reaches another's (a residual sum): that would make the whole
   path between them one unit, so there partitioning wins.  A tree or chain
   continues through the forwards Grappler prunes first (Identity, IdentityN,
   StopGradient); an IdentityN on one joins with all its readers, since a
   partition that returns one of its outputs keeps it and so breaks the chain.
   A control edge *from* a member does not end its chain: Grappler regroups
   through it in the whole function.  (Erfc's gradient, in exact GELU, runs
   under `control_dependencies([grad])`, so an edge starts at the product
   `grad` that begins the chain `grad * -2/sqrt(pi) * exp(-z*z) * 1/sqrt(2)`;
   the whole function folds the two constants into one and multiplies in
   another order.)  A member with control inputs still ends its chain.  A
   cube `pow(x, 3)` is a product (`OpNode.arithmetic_type`): Grappler writes
   it as `x * square(x)` on the CPU and multiplies the chain's constant into
   one of its factors (tfmem/tf2/cubes.py).
   The rule applies only where the arithmetic optimizer runs
   (`view.regrouped_arithmetic`): a session without it (tfmem.Session's
   config) adds an AddN's inputs in input order whichever partition made
   them, so there the rule would only cost memory (a long gradient sum
   would pin every addend on the device at once).
6. *Cycles.*  Joining ops can make two units depend on each other (a loop's
   stack pushed in the forward pass and popped in the backward pass, the
   producers of one sum with a path between them); strongly connected
   components of the unit graph become one unit.

7. *Merged kernels.*  Ops a kernel path runs as one kernel (oneDNN's filter
   and bias gradients of one convolution, see `merged_kernels`) are one unit,
   with the ops on the paths between them (rule 6 joins those): no partition
   or stage boundary falls between them, and no other op is chained there.

v2 control flow (While, If) is a single op and needs none of this.
"""

import networkx as nx

from tfmem.plan import optypes
from tfmem.plan.analyse import split_tensor_name
from tfmem.plan.merged_kernels import merged_groups


class _UnionFind:
    def __init__(self, items):
        self.parent = {item: item for item in items}
        self.unions = 0  # joins made; with none, every op is its own unit

    def find(self, item):
        root = item
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[item] != root:
            self.parent[item], item = root, self.parent[item]
        return root

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.unions += 1


def _producers(view, node):
    """(producer op name, tensor name) of the data inputs copied with the view."""
    return [(op_name, tensor) for op_name, tensor in zip(node.input_ops, node.inputs)
            if op_name in view.nodes]


def _topological_order(view):
    """Nodes in an order where producers come first, v1 loop back edges ignored."""
    names = list(view.nodes)
    return [names[i] for i in _ordered(view)[0]]


def _ordered(view):
    """(positions of the view's nodes in an order where producers come first, per node the
    positions of the nodes that wait for it, by data or control, each once, v1 loop back
    edges left out); positions index `view.nodes`."""
    waits = view.waits
    back = {view.node_index[name] for name, kind in view.control_flow.items()
            if kind in optypes.NEXT_ITERATION}
    indegree = [0] * len(waits)
    consumers = [[] for _ in waits]
    for node, srcs in enumerate(waits):
        if back:
            srcs = [src for src in srcs if src not in back]
        indegree[node] = len(srcs)
        for src in srcs:
            consumers[src].append(node)
    ready = [node for node, count in enumerate(indegree) if count == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for c in consumers[node]:
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    return order, consumers


def _join_run_bound_edges(view, uf):
    """Rule 1: a run-bound tensor (a reference, a handle) with its producer and readers."""
    for name, node in view.nodes.items():
        for index, output in enumerate(node.outputs):
            if output.run_bound:
                for reader in view.readers.get(f"{name}:{index}", ()):
                    uf.union(name, reader)


def _family(node):
    kind = node.arithmetic_type or node.type
    for family in (optypes.SUMS, optypes.PRODUCTS):
        if kind in family:
            return family
    return None


def _on_one_path(producers, successors, position):
    """Whether one of `producers` (positions in the view) reaches another: joining them
    would make every op on the path between them one unit (a residual sum's input and its
    far end), so a sum whose leaves lie on one path keeps its producers apart
    (bit-equality is lost there, partitioning is not).  `successors`, `position`: see
    `_paths`."""
    unordered = len(position)
    last = max((position[p] for p in producers if position[p] < unordered), default=-1)
    for start in producers:
        seen, stack = {start}, [start]
        while stack:
            for user in successors[stack.pop()]:
                if user in producers:
                    return True
                if user not in seen and position[user] <= last:
                    seen.add(user)
                    stack.append(user)
    return False


def _sole_reader(view, readers, controlled, tensor):
    """(op, forwards, tensor it reads): the one op that reads `tensor`, looking through
    the forwards Grappler's model pruner removes before the arithmetic optimizer runs
    (an Identity, an IdentityN port, a StopGradient, with no control edge and not
    fetched), the forwards passed and the tensor the op reads; None unless exactly one
    op reads it.  Keras applies gradients through an IdentityN, so a gradient's last
    product and the optimizer's product with the learning rate form one chain in the
    whole function."""
    forwards = []
    while True:
        names = readers.get(tensor, ())
        if len(names) == 1 and view.nodes[names[0]].type not in optypes.PRUNED_FORWARDS:
            return names[0], tuple(forwards), tensor  # most tensors: one plain reader
        reads = []  # (op, its output forwarding the tensor, or None)
        for name in dict.fromkeys(names):
            user = view.nodes[name]
            if not _pruned_forward(view, user, controlled):
                reads += [(name, None)] * user.inputs.count(tensor)
                continue
            for port, read in enumerate(user.inputs):  # output k forwards input k
                out = f"{name}:{port}"
                if read == tensor and (out in readers or out in view.fetches):
                    reads.append((name, out))  # an output nobody reads is pruned
        if len(reads) != 1:
            return None
        name, out = reads[0]
        if out is None:
            return name, tuple(forwards), tensor
        forwards.append(name)
        tensor = out


def _pruned_forward(view, node, controlled):
    """Whether Grappler removes the forward `node` in the whole function: no control edge
    touches it and no output of it is fetched (a fetched IdentityN stays, all ports)."""
    return node.type in optypes.PRUNED_FORWARDS and not node.control_inputs and \
        node.name not in controlled and \
        not any(f"{node.name}:{port}" in view.fetches for port in range(len(node.inputs)))


def _join_regrouped_arithmetic(view, uf):
    """Rule 5: trees Grappler's arithmetic optimizer regroups stay whole, with their leaves."""
    readers = view.readers
    controlled = {c for node in view.nodes.values() for c in node.control_inputs
                  if c in view.nodes}
    paths = None  # (successors, position), made for the first tree that needs them
    arithmetic = optypes.SUMS | optypes.PRODUCTS  # the families of `_family`
    trees = _UnionFind([name for name, node in view.nodes.items()
                        if (node.arithmetic_type or node.type) in arithmetic])
    forwards, inner_reads = {}, set()  # member -> forwards to its consumer; (op, tensor)
    for name in trees.parent:
        node = view.nodes[name]
        sole = _sole_reader(view, readers, controlled, name + ":0")
        if sole is not None and sole[0] in trees.parent and \
                _family(view.nodes[sole[0]]) is _family(node) and \
                not node.control_inputs:
            trees.union(sole[0], name)
            forwards[name] = sole[1]
            inner_reads.add((sole[0], sole[2]))
    members = {}
    for name in trees.parent:
        members.setdefault(trees.find(name), []).append(name)
    for tree in members.values():
        if len(tree) == 1 and view.nodes[tree[0]].type not in optypes.SUMS and \
                len(view.nodes[tree[0]].inputs) < 3:
            continue  # a lone product of two factors: no leaves to join, nothing hoisted
        inside = set(tree)
        leaves = [(producer, tensor) for name in tree
                  for producer, tensor in _producers(view, view.nodes[name])
                  if producer not in inside and (name, tensor) not in inner_reads]
        leaves += [(None, t) for name in tree for t in view.nodes[name].inputs
                   if split_tensor_name(t)[0] not in view.nodes]
        for name in tree[1:]:
            uf.union(tree[0], name)
        for name in tree:
            for forward in forwards.get(name, ()):
                # and every reader of the forward: a partition that returns one of an
                # IdentityN's outputs keeps the IdentityN, which then breaks the chain
                for reader in [forward] + [r for port in range(len(view.nodes[forward].inputs))
                                           for r in readers.get(f"{forward}:{port}", ())]:
                    uf.union(tree[0], reader)
        hoisted = any(view.nodes[name].type in optypes.SUMS for name in tree) and \
            len(leaves) > 1 and all(  # every leaf a product (or every one a quotient)
                p is not None and view.nodes[p].type in optypes.PRODUCTS | optypes.QUOTIENTS
                for p, _ in leaves)
        producers = {p for p, _ in leaves if p is not None}
        if len(leaves) >= 3 or hoisted:
            paths = paths or _paths(view)
            if not _on_one_path({view.node_index[p] for p in producers}, *paths):
                for producer in producers:
                    uf.union(tree[0], producer)


def _paths(view):
    """(per node the positions of the nodes that wait for it, by data or control; per node
    its place in a topological order, len(view.nodes) for none): what `_on_one_path`
    walks, by positions in the view.  Without v1 loops the order's own edges serve."""
    order, consumers = _ordered(view)
    if any(kind in optypes.NEXT_ITERATION for kind in view.control_flow.values()):
        consumers = [[] for _ in view.waits]
        for node, srcs in enumerate(view.waits):
            for src in srcs:
                consumers[src].append(node)
    position = [len(view.waits)] * len(view.waits)
    for place, node in enumerate(order):
        position[node] = place
    return consumers, position


def _join_frames_and_conds(view, uf):
    """Rules 2 and 3, in one pass over a topological order."""
    frames = {}  # op -> tuple of frame names, outermost first
    guards = {}  # op -> frozenset of (predicate tensor, branch) it may be dead under
    switches_of = {}  # predicate tensor -> Switch ops on it (outside frames)
    switches = set()

    def input_guard(tensor):
        producer, index = split_tensor_name(tensor)
        guard = guards[producer]
        if producer in switches:
            guard = guard | {(view.nodes[producer].inputs[1], index)}
        return guard

    for name in _topological_order(view):
        node = view.nodes[name]
        data = [t for p, t in _producers(view, node) if p in frames]
        control = [c for c in node.control_inputs if c in frames]
        parents = [split_tensor_name(t)[0] for t in data] + control
        stack = frames[parents[0]] if parents else ()
        if node.type in optypes.ENTER:
            stack = stack + (node.frame,)
        elif node.type in optypes.EXIT:
            stack = stack[:-1]
            uf.union(parents[0], name)
        frames[name] = stack

        guard = frozenset().union(*(input_guard(t) for t in data),
                                  *(guards[c] for c in control))
        if node.type in optypes.MERGE:
            branches = {}
            for pred, branch in guard:
                branches.setdefault(pred, set()).add(branch)
            resolved = {pred for pred, seen in branches.items() if len(seen) > 1}
            for pred in resolved:
                uf.union(switches_of[pred][0], name)
            guard = frozenset(g for g in guard if g[0] not in resolved)
        if node.type in optypes.SWITCH and not stack:
            same_pred = switches_of.setdefault(node.inputs[1], [])
            same_pred.append(name)
            uf.union(same_pred[0], name)
            switches.add(name)
        guards[name] = guard
        for pred, _ in guard:
            uf.union(switches_of[pred][0], name)

    outermost = {}
    for name, stack in frames.items():
        if stack:
            uf.union(outermost.setdefault(stack[0], name), name)


def _join_originals(view, uf):
    """Rule 4: an original with the originals its control edges come from."""
    for name in view.originals:
        for src in view.nodes[name].control_inputs:
            if src in view.originals:
                uf.union(src, name)


def _join_merged_kernels(view, uf):
    """Rule 7: ops a kernel path runs as one kernel."""
    for first, *rest in merged_groups(view):
        for other in rest:
            uf.union(first, other)


def _cyclic_units(groups, inputs):
    """Rule 6: the units on a cycle of the unit graph (`inputs`, see `unit_graph`), as
    components of two or more unit indices; none in the usual case, told in linear time."""
    if _acyclic(inputs):
        return []
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(groups)))
    graph.add_edges_from((src, unit) for unit, srcs in enumerate(inputs) for src in srcs)
    return [component for component in nx.strongly_connected_components(graph)
            if len(component) > 1]


def _acyclic(inputs):
    """Whether the graph of units whose edges lead from each unit to its `inputs` has no
    cycle: Kahn's walk takes every unit."""
    readers = [0] * len(inputs)  # per unit, how many units read it
    for srcs in inputs:
        for src in srcs:
            readers[src] += 1
    ready = [unit for unit, count in enumerate(readers) if count == 0]
    taken = 0
    while ready:
        taken += 1
        for src in inputs[ready.pop()]:
            readers[src] -= 1
            if readers[src] == 0:
                ready.append(src)
    return taken == len(inputs)


class Units(tuple):
    """What `units` returns: the units, each a tuple of op names in view order, and, when
    grouping found it, their unit graph (`unit_graph`), which the partitioner walks next."""

    def __new__(cls, groups, graph=None):
        made = super().__new__(cls, groups)
        made.graph = graph
        return made


def unit_graph(view, groups):
    """({op: the index of its unit in `groups`}, per unit the indices of the units it
    reads, by data or control, in the order its ops name them, each once)."""
    if isinstance(groups, Units) and groups.graph is not None:
        return groups.graph
    unit_of = {name: i for i, unit in enumerate(groups) for name in unit}
    unit_at = list(map(unit_of.get, view.nodes))  # by position in the view
    index, waits, inputs = view.node_index, view.waits, []
    for own, unit in enumerate(groups):
        if len(unit) == 1:  # most units: one op, whose producers come each once
            srcs = [src for src in map(unit_at.__getitem__, waits[index[unit[0]]])
                    if src is not None and src != own]
            inputs.append(list(dict.fromkeys(srcs)) if len(srcs) > 1 else srcs)
        else:
            inputs.append(_read_units(view, own, unit, unit_at))
    return unit_of, inputs


def _read_units(view, own, unit, unit_at):
    """The units the ops of unit `own` read, by data or control, in the order its ops name
    them, each once; `unit_at`: per position in the view, the unit of the op there."""
    index, waits = view.node_index, view.waits
    seen, srcs = {own}, []
    for name in unit:
        for src in map(unit_at.__getitem__, waits[index[name]]):
            if src is not None and src not in seen:
                seen.add(src)
                srcs.append(src)
    return srcs


def _joined_graph(view, groups, inputs, joined):
    """`unit_graph(view, joined)`, where `joined` joins some of `groups` (whose unit graph
    reads `inputs`) into one: a unit left whole reads the units its inputs became, each
    once; a joined unit's inputs are found again from its ops."""
    unit_of = {name: i for i, unit in enumerate(joined) for name in unit}
    became = [unit_of[unit[0]] for unit in groups]
    was = [None] * len(joined)  # per unit of `joined`, the one unit of `groups` it is
    parts = [0] * len(joined)
    for old, new in enumerate(became):
        was[new] = old
        parts[new] += 1
    unit_at = list(map(unit_of.get, view.nodes))  # by position in the view
    joined_inputs = []
    for own, unit in enumerate(joined):
        if parts[own] == 1:
            srcs = [became[src] for src in inputs[was[own]]]
            joined_inputs.append(list(dict.fromkeys(srcs)) if len(srcs) > 1 else srcs)
        else:
            joined_inputs.append(_read_units(view, own, unit, unit_at))
    return unit_of, joined_inputs


def _grouped(view, uf):
    """The units of `uf`'s joins: each a tuple of op names in view order, ordered by
    their first op."""
    groups, parent = {}, uf.parent
    for name in view.nodes:
        root = name if parent[name] == name else uf.find(name)
        group = groups.get(root)
        if group is None:
            groups[root] = [name]
        else:
            group.append(name)
    return tuple(tuple(group) for group in groups.values())


def units(view):
    """The view's ops grouped into units (`Units`); each unit lists its ops in view order."""
    uf = _UnionFind(view.nodes)
    _join_run_bound_edges(view, uf)
    _join_originals(view, uf)
    _join_merged_kernels(view, uf)
    if view.regrouped_arithmetic:
        _join_regrouped_arithmetic(view, uf)
    if view.control_flow:
        _join_frames_and_conds(view, uf)
    groups = _grouped(view, uf)
    if not uf.unions:  # single-op units of a DAG form no cycle
        return Units(groups)
    graph = unit_graph(view, groups)
    cycles = _cyclic_units(groups, graph[1])
    if not cycles:
        return Units(groups, graph)
    for first, *rest in cycles:
        for other in rest:
            uf.union(groups[first][0], groups[other][0])
    joined = _grouped(view, uf)
    return Units(joined, _joined_graph(view, groups, graph[1], joined))
