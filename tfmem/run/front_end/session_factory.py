"""Sessions that tfmem creates itself: a config that makes partitions cheap to compile.

Every partition is a Session callable, and TensorFlow's DirectSession builds
each callable from the whole session graph: it copies the graph and, with
Grappler on (the default), converts the whole graph to a GraphDef and runs
the meta optimizer over it before pruning it to the callable's ops
(graph_execution_state.cc, `BuildGraph` / `OptimizeGraph`).  The cost of a
callable therefore grows with the session graph, not with the partition.

`session_config()` turns Grappler's meta optimizer off.  Measured on
TensorFlow 2.21 (tools/bench.py, "first step" table) it cuts the cost of a
callable three to five times; what is left is the copy and the pruning of
the whole graph, which no session option removes.  It also makes
partitioned results bitwise equal to plain `Session.run` on the same
session: Grappler rewrites each callable's subgraph on its own (arithmetic
rewrites, folding), so with it on, a partitioned step and a plain step of
the same graph can differ in the last bits.

`place_pruned_graph` is left off: with it, DirectSession converts a copy of
the whole GraphDef into a new graph and places it for every callable, which
measured no cheaper.

What is left, the copy and the pruning of the whole session graph, is why
`Session` does not bind its session to the user's graph: its session graph
holds only what requests have reached (run/compiling/graph_copy.py), so a partition
costs the same in a graph of 2,000 ops or of 50,000.

    sess = tfmem.Session(graph=g, partition_size=200)   # a TFMemSession
    sess.run(init)                                      # every request goes through it
    sess.graph is g                                     # True; g is never changed
"""

from tensorflow.core.protobuf import config_pb2


def session_config(config=None):
    """A copy of `config` (or a new ConfigProto) with Grappler's meta optimizer off.

    Use it for sessions whose requests run through tfmem; plain runs of that
    session are unoptimized too, so plain and partitioned results stay equal.
    """
    out = config_pb2.ConfigProto()
    if config is not None:
        if not isinstance(config, config_pb2.ConfigProto):
            raise TypeError(f"config must be a tf.compat.v1.ConfigProto, got "
                            f"{type(config).__name__}")
        out.CopyFrom(config)
    out.graph_options.rewrite_options.disable_meta_optimizer = True
    return out


def Session(target="", graph=None, config=None, **settings):  # pylint: disable=invalid-name
    """A TFMemSession over a new `tf.compat.v1.Session(target, config=session_config(config))`
    whose graph is a copy of only what requests reach in `graph` (see graph_copy).

    `graph`: the user's graph (None: the default graph).  `settings` are
    TFMemSession's keyword arguments (partition_size, device_memory_budget, swap,
    swap_distance, prefetch, trace, options).  Closing the TFMemSession closes the
    session it created.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.run.front_end import options  # pylint: disable=import-outside-toplevel
    from tfmem.run.compiling.graph_copy import GraphCopy  # pylint: disable=import-outside-toplevel
    from tfmem.run.front_end.session import TFMemSession  # pylint: disable=import-outside-toplevel
    everyday = {k: v for k, v in settings.items() if k in options.EVERYDAY}
    rest = {k: v for k, v in settings.items() if k not in options.EVERYDAY + ("options",)}
    resolved = options.resolve(settings.get("options"), rest, options.SESSION,
                               caller="tfmem.Session")
    copy = GraphCopy(graph if graph is not None else tf.compat.v1.get_default_graph())
    sess = tf.compat.v1.Session(target, graph=copy.graph, config=session_config(config))
    try:
        return TFMemSession(sess, options=resolved, _graph_copy=copy, **everyday)
    except BaseException:
        sess.close()
        raise
