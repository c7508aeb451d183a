"""Whether a session runs Grappler's arithmetic optimizer, which reorders sums, and its
dependency optimizer, which removes IdentityN ops (see memory/op_order.py).

The optimizer sorts an AddN's inputs by name and collapses trees of sums, so a
partition boundary inside a sum would change its float result; plan/units.py
(rule 5) then keeps such a sum whole with its addends.  Where the optimizer
does not run, AddN adds in input order whichever partition made its inputs,
and the rule would only cost memory.  Checked on TensorFlow 2.21 with an AddN
of eight MatMuls named out of order (see tests/test_regrouping.py): a default
session adds them in name order; one with any of the settings below adds them
in input order.  DirectSession's GraphExecutionState::OptimizeGraph returns
"Can't optimize a pruned graph" under place_pruned_graph, and the session then
runs the unoptimized graph.
"""

from tensorflow.core.protobuf import rewriter_config_pb2

from tfmem import tf_private


def _runs_optimizer(config, setting):
    """False when the ConfigProto `config` (None: defaults) keeps the Grappler optimizer
    whose RewriterConfig field is `setting` from running; True otherwise, and whenever
    unsure (the planner's rules and the simulator's orders are safe either way)."""
    if config is None:
        return True
    graph_options = config.graph_options
    rewrite = graph_options.rewrite_options
    return not (graph_options.place_pruned_graph or rewrite.disable_meta_optimizer or
                getattr(rewrite, setting) == rewriter_config_pb2.RewriterConfig.OFF)


def runs_arithmetic_optimizer(config):
    """Whether the ConfigProto `config` runs Grappler's arithmetic optimizer."""
    return _runs_optimizer(config, "arithmetic_optimization")


def session_regroups_arithmetic(session):
    """Whether plans of requests `session` runs must keep regrouped sums whole."""
    return runs_arithmetic_optimizer(tf_private.config_of(session))


def runs_dependency_optimizer(config):
    """Whether the ConfigProto `config` runs Grappler's dependency optimizer."""
    return _runs_optimizer(config, "dependency_optimization")


def session_removes_identities(session):
    """Whether `session` runs Grappler's dependency optimizer, which removes IdentityN ops."""
    return runs_dependency_optimizer(tf_private.config_of(session))
