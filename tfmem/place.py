"""Place: keep state in host memory when the session has an accelerator.

Variables and large constants live for the whole session, while each
partition uses only a few of them.  Kept on the host, they reach the
accelerator only for the run of a partition that reads them (TensorFlow
copies a host tensor to its consumer's device for that run).

tfmem never changes the user's ops, and a variable's device is a property of
the user's VarHandleOp / VariableV2: its state lives where that op runs.  So
the pass moves what tfmem can move on its own and reports the rest:

* constants of at least `min_bytes`: each plan reads a host-placed copy;
* variables already on the host: nothing to do;
* variables the graph puts on (or leaves free for) the accelerator: left
  where they are, with the fix: build them under `tfmem.state_on_host()`.

On a session without an accelerator there is nothing to move, and the
placement says so.
"""

import contextlib
import dataclasses
import types

HOST_DEVICE = "/device:CPU:0"
DEFAULT_MIN_BYTES = 1 << 20
VARIABLES = frozenset({"VarHandleOp", "_VarHandlesOp", "VariableV2", "Variable"})


def _on_host(device):
    return "CPU" in device.upper()


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the plan's state goes: `moved` ops run on the host, `stays` explains the rest."""
    accelerator: str | None
    moved: types.MappingProxyType  # op name -> device (constants copied to the host)
    stays: types.MappingProxyType  # variable op -> why it stays where the graph puts it

    def __str__(self):
        if self.accelerator is None:
            return "placement: the session has no accelerator; nothing to move"
        lines = [f"placement: {len(self.moved)} constants to {HOST_DEVICE}, "
                 f"{len(self.stays)} variables left where the graph puts them"]
        lines += [f"  {name}: {why}" for name, why in sorted(self.stays.items())]
        return "\n".join(lines)


def place(view, accelerator, min_bytes=DEFAULT_MIN_BYTES):
    """The placement of the view's state, for a session whose accelerator is `accelerator`."""
    moved, stays = {}, {}
    if accelerator is not None:
        for name, node in view.sources.items():
            if node.type == "Const" and (node.outputs[0].nbytes or 0) >= min_bytes \
                    and not _on_host(node.device):
                moved[name] = HOST_DEVICE
            elif node.type in VARIABLES and not _on_host(node.device):
                where = node.device or "unassigned (the accelerator)"
                stays[name] = (f"device {where} is set by the graph, and tfmem does not change "
                               "the user's ops; create the variable under "
                               "`with tfmem.state_on_host():` to keep it on the host")
    return Placement(accelerator, types.MappingProxyType(moved), types.MappingProxyType(stays))


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

