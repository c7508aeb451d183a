"""Swap policy: where each transfer waits between its producer and its readers.

A transfer lives on the device as a session handle over a *span* of
partitions: either the producer's own output, or a copy uploaded again from
host memory.  Between two uses more than `swap_distance` partitions apart,
the device copy is released and the tensor waits in a host buffer (taken
right after the producer); the prefetcher uploads it again `prefetch`
partitions before the next reader:

    partition:   0    1    2    3    4    5    6
    producer     P
    readers           r                        r
    device       [====]                   [====]    spans: (0 -> 1), (5 -> 6)
    host              [===================]         host copy until its upload

"auto" swaps gaps longer than swap_distance for tensors of at least
`min_bytes` (a small tensor costs more in Session calls than it frees; a
tensor of unknown static size counts as large), "all" swaps every gap and
"none" never swaps.  Tensors that cannot be fetched to numpy (strings,
variants) always stay on the device.
"""

import dataclasses
import functools
import numbers

import tensorflow as tf

SWAP_MODES = ("auto", "all", "none")


@dataclasses.dataclass(frozen=True)
class SwapPolicy:
    """The user's swap settings, checked once."""
    mode: str = "auto"
    swap_distance: int = 2
    prefetch: int = 1
    min_bytes: int = 1 << 20

    def __post_init__(self):
        if self.mode not in SWAP_MODES:
            raise ValueError(f"swap must be one of {', '.join(map(repr, SWAP_MODES))}, "
                             f"got {self.mode!r}")
        for name in ("swap_distance", "prefetch", "min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Span:
    """One stay of a transfer in device memory, read by `readers`; the last one frees it."""
    start: int  # the producer's partition, or the partition during which it is uploaded
    readers: tuple
    uploaded: bool


@functools.lru_cache(maxsize=None)  # asked for every crossing of every candidate plan
def swappable(dtype):
    """Fixed-size numeric tensors can wait in a host buffer."""
    dtype = tf.as_dtype(dtype)
    return dtype.is_numpy_compatible and dtype not in (tf.string, tf.resource, tf.variant)


def worth_swapping(info, policy):
    """Whether the policy may swap a tensor with this TensorInfo at all."""
    if not swappable(info.dtype):
        return False
    return policy.mode == "all" or info.nbytes is None or info.nbytes >= policy.min_bytes


def spans(producer, readers, policy, can_swap):
    """The device spans of a transfer produced at `producer` and read at `readers`."""
    result, current, previous = [], [], producer
    uploaded, start = False, producer
    for reader in readers:
        gap = reader - previous
        keep = not can_swap or policy.mode == "none" or (
            policy.mode == "auto" and gap <= policy.swap_distance)
        if not keep:
            if current:
                result.append(Span(start, tuple(current), uploaded))
            # Upload no earlier than the previous reader: two copies would overlap.
            start = max(reader - policy.prefetch, producer + 1, previous)
            uploaded, current = True, []
        current.append(reader)
        previous = reader
    result.append(Span(start, tuple(current), uploaded))
    return tuple(result)
