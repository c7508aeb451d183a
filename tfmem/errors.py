"""The exception hierarchy: every error tfmem raises itself derives from TFMemError.

Mistakes in a request (a bad fetch, a feed of the wrong shape, an unfed
placeholder) raise what `Session.run` raises for the same request, so that a
wrapped session fails exactly like a plain one.  TFMemError is for what only
tfmem can get wrong: a graph it cannot partition or a plan that breaks an
invariant.  Out of device memory inside a partition is DeviceMemoryError, which
is also TensorFlow's ResourceExhaustedError so existing handlers still catch it.
"""


import re

# "OOM when allocating tensor with shape[128,16,16,256] and type float on ...": how
# TensorFlow's allocators name the tensor they could not allocate.
_FAILED_TENSOR = re.compile(r"allocating tensor with shape\[([0-9, ]*)\] and type (\w+)")


def failed_tensor(message):
    """(shape, TensorFlow's dtype name) of the tensor an out-of-memory message says could
    not be allocated, or None where it names none."""
    match = _FAILED_TENSOR.search(message or "")
    if match is None:
        return None
    return tuple(int(d) for d in match.group(1).split(",") if d.strip()), match.group(2)


class TFMemError(Exception):
    """Base class of tfmem's own errors."""


class UnsupportedGraphError(TFMemError):
    """The request reaches a graph construct tfmem cannot run in partitions."""


class InvalidPlanError(TFMemError):
    """A plan breaks one of the invariants checked by `tfmem.validate`."""


class BudgetError(TFMemError):
    """No plan fits the device-memory budget, even with one op per partition."""


class HostMemoryError(TFMemError):
    """The plan needs more host memory for swapped tensors than the machine has free."""


def _device_memory_error_class():
    """DeviceMemoryError, built on first use: it derives from TensorFlow's
    ResourceExhaustedError, and importing this module must not import TensorFlow
    (emulate_accelerator has to run before that)."""
    from tensorflow.python.framework.errors_impl import ResourceExhaustedError  # pylint: disable=import-outside-toplevel

    class DeviceMemoryError(TFMemError, ResourceExhaustedError):
        """A partition ran out of device memory.

        Also a `tf.errors.ResourceExhaustedError`, so code that catches
        TensorFlow's out-of-memory error keeps working.  The message names
        the partition, its largest tensors and a setting the simulator
        predicts would fit; the same figures are attributes.
        """

        def __init__(self, message, node_def=None, partition=None, ops=0, largest=(),
                     partition_size=None, budget=None, swap=None, failed_op=None,
                     request=None):
            ResourceExhaustedError.__init__(self, node_def, None, message)
            self.partition = partition  # index of the partition that failed
            self.ops = ops  # how many ops it runs
            self.largest = tuple(largest)  # ((tensor name, bytes), ...), largest first
            self.partition_size = partition_size  # a partition_size predicted to fit, or None
            self.budget = budget  # the device_memory_budget (bytes) that prediction used
            self.swap = swap  # the swap mode of that prediction
            self.failed_op = failed_op  # the op of the plan that failed, when TensorFlow named it
            self.request = request  # bytes of the allocation that failed, when TensorFlow said

    DeviceMemoryError.__module__, DeviceMemoryError.__qualname__ = __name__, "DeviceMemoryError"
    return DeviceMemoryError


def __getattr__(name):
    if name == "DeviceMemoryError":
        globals()[name] = _device_memory_error_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
