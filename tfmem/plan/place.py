"""Place: keep state in host memory when the session has an accelerator.

Variables and large constants live for the whole session, while each
partition uses only a few of them.  Kept on the host, they reach the
accelerator only for the run of a partition that reads them (TensorFlow
copies a host tensor to its consumer's device for that run).

The placement pass (`placement_pass`) sets the device of the user's state
ops to the host before the session first places them; this module describes
its outcome for one plan, as a `Placement`:

* `moved`: variables and constants of at least `min_bytes` the pass put on
  the host (with their colocation groups: initializers, reads, updates);
* `stays`: those left on the accelerator, and why (the session had already
  placed them, a colocated op has no CPU kernel...);
* `copied`: large constants that stayed; the plan reads host copies of them.

Planned without a session (`make_plan(view, ..., accelerator='GPU:0')`), `moved`
lists what the pass would move.  On a session without an accelerator, or
with `place_state_on_host=False`, there is nothing to move, and the
placement says so.  `state_on_host()` does the same at graph construction.
"""

import contextlib
import dataclasses
import functools
import types

from tfmem.plan.optypes import VARIABLES

HOST_DEVICE = "/device:CPU:0"
DEFAULT_MIN_BYTES = 1 << 20
_EMPTY = types.MappingProxyType({})


@functools.lru_cache(maxsize=4096)
def _spec(device):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        return tf.DeviceSpec.from_string(device or "")
    except ValueError:
        return None


def on_host(device):
    """True for a device string naming the host CPU (CPU:0 of any job and task)."""
    spec = _spec(device)
    return spec is not None and (spec.device_type or "").upper() == "CPU" and \
        spec.device_index in (None, 0)


def host_device_of(device):
    """The host CPU of the job and task `device` names ('/device:CPU:0' locally)."""
    spec = _spec(device)
    if spec is None or not (spec.job or spec.task is not None or spec.replica is not None):
        return HOST_DEVICE
    return spec.replace(device_type="CPU", device_index=0).to_string()


def is_state(node_type, nbytes, min_bytes):
    """True for what the pass moves: a variable, or a constant of at least min_bytes."""
    return node_type in VARIABLES or (node_type == "Const" and (nbytes or 0) >= min_bytes)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the plan's state goes; see the module docstring."""
    accelerator: str | None
    moved: types.MappingProxyType  # state op -> the host device it runs on
    stays: types.MappingProxyType  # state op -> why it stays on the accelerator
    copied: types.MappingProxyType = dataclasses.field(
        default_factory=lambda: _EMPTY)  # constant -> device of the host copy read
    moved_bytes: int = 0  # bytes of the moved variables and constants (known shapes)
    predicted: bool = False  # planned without a session: what the pass would move

    def __str__(self):
        if self.accelerator is None:
            return ("placement: nothing to move (the session has no accelerator, "
                    "or Options(place_state_on_host=False))")
        verb = "would move" if self.predicted else "moved"
        lines = [f"placement: {verb} {len(self.moved)} state ops "
                 f"({self.moved_bytes / (1 << 20):.1f} MiB) from {self.accelerator} to "
                 f"{HOST_DEVICE}; {len(self.stays)} stay on the accelerator"
                 + (f", {len(self.copied)} constants read from host copies"
                    if self.copied else "")]
        lines += [f"  {name}: {why}" for name, why in sorted(self.stays.items())]
        return "\n".join(lines)


def _state_bytes(node):
    return node.state_bytes if node.type in VARIABLES else (node.outputs[0].nbytes or 0)


def place(view, accelerator, min_bytes=DEFAULT_MIN_BYTES, outcome=None):
    """The placement of the view's state on a session whose accelerator is `accelerator`.

    `outcome` is the pass's record on that session (`placement_pass.Record`:
    `moved` and `stays` by op name); without one, the placement is predicted.
    """
    if view is None or accelerator is None:
        return Placement(accelerator, _EMPTY, _EMPTY)
    moved, stays, copied, nbytes = {}, {}, {}, 0
    for name, node in view.sources.items():
        if not is_state(node.type, node.outputs[0].nbytes, min_bytes):
            continue
        if outcome is not None and name in outcome.moved or \
                outcome is None and not on_host(node.device):
            moved[name] = node.device if outcome is not None else host_device_of(node.device)
            nbytes += _state_bytes(node)
        elif outcome is not None and not on_host(node.device):
            stays[name] = outcome.stays.get(
                name, "not seen by the placement pass (created after its last run)")
            if node.type == "Const":
                copied[name] = HOST_DEVICE
    return Placement(accelerator, types.MappingProxyType(moved), types.MappingProxyType(stays),
                     types.MappingProxyType(copied), nbytes, predicted=outcome is None)


@contextlib.contextmanager
def state_on_host(graph=None, min_bytes=DEFAULT_MIN_BYTES):
    """Build variables (and constants of at least min_bytes) on the host CPU.

        with tfmem.state_on_host():
            logits = build_model(x)      # its variables live in host memory

    Initializers and reads follow their variable by TensorFlow's colocation.
    Inner `tf.device` scopes still win.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    graph = graph or tf.compat.v1.get_default_graph()

    def device_of(op):
        if op.type in VARIABLES:
            return HOST_DEVICE
        if op.type == "Const" and op.outputs[0].dtype.is_numpy_compatible and \
                (op.outputs[0].shape.num_elements() or 0) * op.outputs[0].dtype.size >= min_bytes:
            return HOST_DEVICE
        return op.device

    with graph.device(device_of):
        yield
