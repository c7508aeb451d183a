"""The placement pass: put the user's state on the host before the session places it.

On a session with an accelerator, the pass sets the device of every variable
and every constant of at least `min_bytes` to the host CPU, together with the
ops TensorFlow colocates with them (see `colocation`): initializers, reads,
assigns, optimizer updates and slot variables.  Nothing else of the user's
graph changes; the model's compute stays where the graph puts it, and
TensorFlow copies a variable's value to it for each step.

What TensorFlow 2.21 does with a device set on an existing op (checked with
two CPU devices, `ConfigProto(device_count={'CPU': 2})`):

* A session copies the graph into its runtime at each `run` ("extends" with
  every op created since the last one) and places that copy.  A device set
  on an op before any `run` of the session since the op was created takes
  effect, for the plain session as for tfmem (it is the same graph).
* A device set on an op the session already holds is ignored: no error, the
  op keeps its old device, and TensorFlow logs "was changed by setting device
  after it was run by a session. This mutation will have no effect".  This
  happens after any `run`, even of an unrelated op.

Python cannot ask a session which ops it holds, so the pass sets the devices,
then asks TensorFlow: one `run` fetching a scalar colocated with each moved group
(`output_partition_graphs`) shows the device the session gave the group.
Nothing else runs.  A group left on the accelerator gets its old devices back
(so the graph tells the truth; TensorFlow logs its warning once more), and is
listed in the plan's placement with the reason, with one warning saying how
to get the placement: wrap the session before its first run, or build the
model under `tfmem.state_on_host()`.
"""

import logging

import tensorflow as tf
from tensorflow.python.framework import kernels

from tfmem.run.compiling.colocation import colocation_groups
from tfmem.plan.optypes import VARIABLES
from tfmem.plan.place import HOST_DEVICE, host_device_of, is_state, on_host
from tfmem import tf_private

log = logging.getLogger(__name__)

PROBE_SCOPE = "tfmem/placement_probe"
ALREADY_PLACED = ("the session had already placed it on {device} before tfmem could move it "
                  "(TensorFlow ignores a device set after a session ran the graph)")


class Record:
    """The pass's decisions on one session's graph, op by op."""

    def __init__(self):
        self.moved = {}  # variable or constant -> bytes, now on the host
        self.stays = {}  # variable or constant -> why it stays on the accelerator
        self.graph_version = -1  # the graph version the pass last looked at

    def decided(self, name):
        return name in self.moved or name in self.stays


def _bytes_of(op):
    """Bytes of a variable's value or a constant of known shape, else 0."""
    if op.type in VARIABLES:
        try:
            shape, dtype = tf.TensorShape(op.get_attr("shape")), tf.as_dtype(op.get_attr("dtype"))
        except ValueError:  # _VarHandlesOp: several variables, list attributes
            return 0
    else:
        shape, dtype = op.outputs[0].shape, op.outputs[0].dtype
    if not shape.is_fully_defined() or not dtype.is_numpy_compatible or dtype == tf.string:
        return 0
    return shape.num_elements() * dtype.size


def _seeds(graph, min_bytes, record):
    """The variables and large constants on (or free for) the accelerator not yet decided."""
    return [op for op in graph.get_operations()
            if (op.type in VARIABLES or op.type == "Const") and not record.decided(op.name)
            and not op.name.startswith("tfmem/") and not on_host(op.device)
            and is_state(op.type, _bytes_of(op), min_bytes)]


_CPU_KERNEL = {}


def _has_cpu_kernel(op_type):
    known = _CPU_KERNEL.get(op_type)
    if known is None:
        registered = kernels.get_registered_kernels_for_op(op_type).kernel
        known = _CPU_KERNEL[op_type] = any(k.device_type == "CPU" for k in registered)
    return known


def _why_it_stays(ops, seeds, record):
    """Why the group `ops` cannot go to the host as a whole, or None when it can."""
    for op in ops:
        if op.name in record.stays:
            return f"colocated with '{op.name}', which stays on the accelerator"
        if not on_host(op.device) and not _has_cpu_kernel(op.type):
            return f"colocated with '{op.name}' ({op.type}), which has no CPU kernel"
    if not any(seed.type in VARIABLES for seed in seeds):
        for op in ops:
            if op.type != "Const":
                return (f"colocated with '{op.name}' ({op.type}), which is not state; "
                        "the pass moves no compute")
    return None


def _probe(session, seeds):
    """{seed name: device the session placed it on}, from one run of colocated scalars."""
    graph, probes = session.graph, {}
    with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None):
        for index, seed in enumerate(seeds):
            # Distinct values: Grappler merges identical ops, which would hide a group.
            # Float: Grappler pins small int32 ops to the host on a GPU, whatever the group.
            with graph.device(None), graph.colocate_with(seed, ignore_existing=True):
                probe = tf.constant(float(index), tf.float32, name=PROBE_SCOPE)
            tf_private.set_device(probe.op, "")  # ours: follow the group
            probes[probe.op.name] = seed.name
    metadata = tf.compat.v1.RunMetadata()
    options = tf.compat.v1.RunOptions(output_partition_graphs=True)
    session.run([name + ":0" for name in probes], options=options, run_metadata=metadata)
    return {probes[node.name]: node.device for partition in metadata.partition_graphs
            for node in partition.node if node.name in probes}


def _move(groups, session):
    """Set the groups' devices to the host; keep it where the session honours it.

    Returns {seed name: why it stays} for the seeds whose group the session
    kept elsewhere (their ops get their old devices back).
    """
    old = {}

    def undo(ops):
        for op in ops:
            if op in old:
                tf_private.set_device(op, old[op])

    for ops, _ in groups:
        for op in ops:
            if not on_host(op.device):
                old[op] = op.device
                tf_private.set_device(op, host_device_of(op.device))
    try:
        placed = {name: (device, ALREADY_PLACED.format(device=device)) for name, device in
                  _probe(session, [seeds[0] for _, seeds in groups]).items()}
    except tf.errors.OpError as error:
        why = "TensorFlow refused it on the host: " + " ".join(error.message.split())[:300]
        placed = {seeds[0].name: ("", why) for _, seeds in groups}
    except BaseException:
        undo(old)  # the graph as it was, whatever stopped the probe
        raise
    refused = {}
    for ops, seeds in groups:
        device, why = placed.get(seeds[0].name, ("", "TensorFlow did not report its device"))
        if not on_host(device):
            undo(ops)
            refused.update({seed.name: why for seed in seeds})
    return refused


def place_state_on_host(session, min_bytes, record):
    """Run the pass over the ops of the session's graph it has not decided yet."""
    graph = session.graph
    if graph.version == record.graph_version:
        return
    record.graph_version = graph.version
    seeds = _seeds(graph, min_bytes, record)
    if not seeds:
        return
    members = colocation_groups(graph)
    by_group = {}
    for seed in seeds:
        by_group.setdefault(members.get(seed.name, frozenset([seed.name])), []).append(seed)
    movable = []
    for names, group_seeds in by_group.items():
        ops = [graph.get_operation_by_name(name) for name in sorted(names)]
        reason = "the graph is finalized" if graph.finalized else \
            _why_it_stays(ops, group_seeds, record)
        if reason:
            record.stays.update((seed.name, reason) for seed in group_seeds)
        else:
            movable.append((ops, group_seeds))
    refused = _move(movable, session) if movable else {}
    count = nbytes = 0
    for ops, seeds_of_group in movable:
        for seed in seeds_of_group:
            if seed.name in refused:
                record.stays[seed.name] = refused[seed.name]
            else:
                record.moved[seed.name] = _bytes_of(seed)
                count, nbytes = count + 1, nbytes + _bytes_of(seed)
    record.graph_version = graph.version  # the probes are not the user's
    if count:
        log.info("placement: moved %d variables and constants (%.2f MiB) and the ops colocated "
                 "with them to %s", count, nbytes / (1 << 20), HOST_DEVICE)
    others = [s.name for s in seeds if s.name in record.stays and s.name not in refused]
    if others:
        log.info("placement: %d variables and constants stay on the accelerator, e.g. "
                 "'%s': %s", len(others), others[0], record.stays[others[0]])
    stuck = sorted(refused)
    if stuck:
        log.warning("placement: %d variables and constants stay on the accelerator (see "
                    "plan.placement), e.g. '%s': %s. To keep them on the host, wrap the "
                    "session in TFMemSession before its first run, or build the model under "
                    "`with tfmem.state_on_host():`.", len(stuck), stuck[0], record.stays[stuck[0]])
