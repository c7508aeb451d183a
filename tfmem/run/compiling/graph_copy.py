"""The session graph of a session tfmem creates: a copy of only what requests reach.

DirectSession builds every callable from the whole session graph: it copies
the graph and prunes it to the callable's ops.  A partition of 50 ops in a
session graph of 50,000 therefore costs what the 50,000 cost, and a user's
graph often holds many ops a training step never runs (evaluation towers,
summaries, other models).  A wrapped session's graph is the user's, so this
cannot be helped there.  A session that tfmem creates (`tfmem.Session`) is
bound to a graph of its own instead, which holds:

* the ops requests have reached, under the user's names: what the fetches and
  targets read, by data or control edges, with the ops they are colocated
  with and the ops named as their name scopes, copied on a request's first
  run; and
* tfmem's copies of plans, as in a wrapped session's graph; and
* one NoOp (`tfmem/shared_controls`) for each set of many control inputs that
  several copied ops share.  `with tf.control_dependencies(update_ops):
  train = optimizer.minimize(loss)` gives every gradient op created inside a
  control edge from every update op: hundreds of thousands of edges in a deep
  network, which DirectSession copies for every callable.  Through the NoOp the
  ops wait for the same ops, and each shared set is written once.

The user's graph is never changed: plan copies go into this graph.  Copied
ops are not updated when the user later changes an op (a device set after the
first run), which is what a plain session does with an op it has run.
"""

import threading

import tensorflow as tf

from tfmem import tf_private
from tfmem.plan.analyse import canonical_input

# An op with at least this many control inputs waits on them through a shared NoOp.
SHARED_CONTROLS_MIN = 8
_SHARED_CONTROLS_NAME = "tfmem/shared_controls"


class GraphCopy:
    """`graph`: the session graph; `source`: the user's graph it copies from."""

    def __init__(self, source):
        self.source = source
        self.graph = tf.Graph()
        self._copied = set()  # names of the source's ops in `graph`
        self._functions = set()  # names of the source's functions in `graph`
        self._shared_controls = {}  # frozenset of "^name" control inputs -> its NoOp's name
        self._lock = threading.Lock()

    def reach(self, ops):
        """Copy `ops` (the source's) and what they depend on, where not copied yet.
        True when something was copied."""
        if all(op.name in self._copied for op in ops):
            return False
        with self._lock:
            new = self._closure(ops)
            if new:
                self._import(new)
            return bool(new)

    def _closure(self, ops):
        """{name: (op, NodeDef)} of the source ops `ops` need that are not copied yet:
        themselves, what they read (data and control inputs), and the colocated and
        scope-named ops of each."""
        found, stack = {}, [op for op in ops if op.name not in self._copied]
        by_name = tf_private.ops_by_name(self.source)
        while stack:
            op = stack.pop()
            if op.name in found:
                continue
            node = op.node_def
            found[op.name] = (op, node)
            before = [t.op for t in op.inputs] + list(op.control_inputs)
            before += _colocated(op, node, by_name) + _named_as_scope_of(op, by_name)
            stack.extend(o for o in before if o.name not in self._copied and o.name not in found)
        return found

    def _import(self, found):
        """Import `found` (see _closure) into the copy, reading what was copied before."""
        graph_def = tf.compat.v1.GraphDef()
        graph_def.versions.CopyFrom(self.source.graph_def_versions)
        new_functions = tf_private.function_library(self.source, self._functions)
        graph_def.library.CopyFrom(new_functions)
        for _, node in found.values():
            graph_def.node.append(node)
        self._share_controls(graph_def)
        new = {node.name for node in graph_def.node}
        tensors, controls = {}, {}  # what the new ops read of ops copied before
        for node in graph_def.node:
            for name in node.input:
                source = name.lstrip("^").partition(":")[0]
                if source in new:
                    continue
                if name.startswith("^"):
                    controls[source] = self.graph.get_operation_by_name(source)
                else:
                    tensors[name] = self.graph.get_tensor_by_name(canonical_input(name))
        try:
            tf_private.import_beside(self.graph, graph_def, tensors, controls)
        except tf.errors.InvalidArgumentError as err:
            if "already exists" not in err.message:
                raise
            raise ValueError(
                f"{err.message}: an op of the graph tfmem.Session runs is named like one of "
                f"tfmem's own ops in the session graph, or their name scopes ('tfmem/...'); "
                f"rename the op") from None
        for name, (op, _) in found.items():
            copy = self.graph.get_operation_by_name(name)
            for tensor, copied in zip(op.outputs, copy.outputs):
                # a set_shape the NodeDef does not carry (compared as cached: cheap)
                if tf_private.static_shape(tensor) != tf_private.static_shape(copied):
                    copied.set_shape(tensor.shape)
        self._copied.update(found)
        self._functions.update(f.signature.name for f in new_functions.function)

    def _share_controls(self, graph_def):
        """Give the nodes of `graph_def` with many control inputs one shared NoOp per set
        (see the module docstring), reusing the NoOps of earlier imports.  The NodeDefs
        are the copy's own (`Operation.node_def` returns a new one)."""
        for node in list(graph_def.node):
            controls = [name for name in node.input if name.startswith("^")]
            if len(controls) < SHARED_CONTROLS_MIN:
                continue
            key = frozenset(controls)
            shared = self._shared_controls.get(key)
            if shared is None:
                shared = self.graph.unique_name(_SHARED_CONTROLS_NAME, mark_as_used=True)
                graph_def.node.add(name=shared, op="NoOp", input=sorted(key))
                self._shared_controls[key] = shared
            inputs = [name for name in node.input if not name.startswith("^")]
            del node.input[:]
            node.input.extend(inputs + ["^" + shared])

    def tensor(self, tensor):
        """The copy of a source tensor."""
        return self.graph.get_tensor_by_name(tensor.name)

    def op(self, op):
        """The copy of a source op."""
        return self.graph.get_operation_by_name(op.name)


def _colocated(op, node, by_name):
    """The ops `op` is to be placed with (its `_class` "loc:@name" constraints; one
    naming no op binds nothing, as in TensorFlow's placer)."""
    if "_class" not in node.attr:
        return []
    names = (group.decode()[len("loc:@"):] for group in node.attr["_class"].list.s)
    return [by_name[n] for n in names if n in by_name and n != op.name]


def _named_as_scope_of(op, by_name):
    """The ops named as a name scope around `op` ("a" and "a/b" for "a/b/c").

    TensorFlow's importer refuses an op named like a name scope already in the graph
    ("a/b" once "a/b/c" is there), so such ops are copied no later than `op`."""
    parts = op.name.split("/")
    names = ("/".join(parts[:end]) for end in range(1, len(parts)))
    return [by_name[n] for n in names if n in by_name]
