"""A `Session.run` request, normalised: fed tensors with their values, and the
unique tensors and ops to fetch.

To return exactly what `Session.run` returns, tfmem reuses TensorFlow's own
fetch handler for the fetch structure (lists, tuples, namedtuples, dicts,
sparse tensors, registered conversions, names as strings) and checks feeds the
way `Session.run` does, raising the same exceptions for the same mistakes.
The fetch handler is private TensorFlow API; it has been stable since
TensorFlow 1.0 and the tests pin its behaviour against a plain session.
"""

import copy as copy_module

import numpy as np
from tensorflow.python.framework import tensor as tf_tensor

from tfmem import tf_private
from tfmem.run.executing.buffers import ALIGNMENT, aligned_bytes


def _expand_feed(key, value):
    """Split a feed into (tensor key, value) pairs, as Session.run does."""
    for key_type, _, feed_fn, _ in tf_private.feed_expansions():
        if isinstance(key, key_type):
            return feed_fn(key, value)
    raise TypeError(f'{key} in argument `feed_dict` has invalid type '
                    f'"{type(key).__name__}"')


def _flatten_feed_dict(feed_dict):
    """Pairs of (key, value); tuple keys map element-wise to tuple values."""
    pairs = []
    for key, value in feed_dict.items():
        if isinstance(key, (tuple, list)) and not hasattr(key, "_fields"):
            if not isinstance(value, (tuple, list)) or len(key) != len(value):
                raise ValueError(f"Feed key {key!r} is a sequence; its value must be "
                                 "a sequence of the same length.")
            pairs.extend(_flatten_feed_dict(dict(zip(key, value))))
        else:
            pairs.append((key, value))
    return pairs


def _feed_value(tensor, value):
    """Convert one feed value to the numpy array Session.run would feed."""
    if isinstance(value, tf_tensor.Tensor):
        raise TypeError(
            "The value of a feed cannot be a tf.Tensor object. Acceptable feed "
            "values include Python scalars, strings, lists, numpy ndarrays. For "
            f"reference, the tensor object was {value} which was fed to {tensor.name}.")
    np_dtype = tensor.dtype.as_numpy_dtype
    # Session.run's own check, with its converter: an int that does not survive
    # the conversion (too large, or fed to a string tensor) is a TypeError; one
    # too large for numpy at all raises numpy's OverflowError, as there.
    if isinstance(value, int) and tf_private.convert_to_numpy_obj(np_dtype, value) != value:
        raise TypeError(
            f"Type of feed value {value} with type {type(value)} is not compatible "
            f"with Tensor type {np_dtype}. Try explicitly setting the type of the "
            "feed tensor to a larger type (e.g. int64).")
    array = np.asarray(value, dtype=np_dtype)
    if not tensor.shape.is_compatible_with(array.shape):
        raise ValueError(f"Cannot feed value of shape {array.shape} for Tensor "
                         f"{tensor.name}, which has shape {tensor.shape}")
    if not tensor.graph.is_feedable(tensor):
        raise ValueError(f"Tensor {tensor.name} may not be fed.")
    return array


def aligned_feed(array):
    """`array`, or a copy of it that starts on a 64-byte boundary when it does not.

    TensorFlow runs on a fed numeric array in place when its data is so aligned, and
    otherwise copies it into an allocator for every run it is fed to.  Which allocator
    depends on what the process ran before: after `reserve_emulated_memory`, or after a
    session ran before the first array was fed, it is the CPU device's own, and every
    partition's run that reads the feed holds a copy of it there, which the simulator
    does not count.  One aligned copy per step keeps the feeds out of device memory."""
    if array.dtype.kind not in "biufc" or array.ctypes.data % ALIGNMENT == 0:
        return array
    copy = aligned_bytes(array.nbytes).view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


class Request:
    """One call's fetches and feeds, resolved against the session's graph."""

    def __init__(self, graph, fetches, feed_dict=None):
        self.feeds = {}  # Tensor -> numpy value, in feed_dict order
        for key, value in _flatten_feed_dict(feed_dict or {}):
            for sub_key, sub_value in _expand_feed(key, value):
                try:
                    tensor = graph.as_graph_element(sub_key, allow_tensor=True,
                                                    allow_operation=False)
                except Exception as e:  # Session.run reports any lookup failure so
                    raise TypeError(f"Cannot interpret feed_dict key as Tensor: {e.args[0]}") from e
                self.feeds[tensor] = _feed_value(tensor, sub_value)
        feeds_by_ref = {t.ref(): v for t, v in self.feeds.items()}
        self._handler = tf_private.fetch_handler(graph, fetches, feeds_by_ref)
        self.fetch_tensors = tuple(self._handler.fetches())
        self.targets = tuple(self._handler.targets())
        self.copy_time = 0.0  # seconds copying what it reaches (see TFMemSession._request)

    @property
    def signature(self):
        """What decides the plan: names fetched, run and fed."""
        return (tuple(t.name for t in self.fetch_tensors),
                tuple(op.name for op in self.targets),
                frozenset(t.name for t in self.feeds))

    def moved_to(self, copy):
        """This request on the session graph of a `graph_copy.GraphCopy` that has reached it
        (the same names; results are built with this request's fetch structure)."""
        moved = copy_module.copy(self)
        moved.feeds = {copy.tensor(t): v for t, v in self.feeds.items()}
        moved.fetch_tensors = tuple(copy.tensor(t) for t in self.fetch_tensors)
        moved.targets = tuple(copy.op(op) for op in self.targets)
        return moved

    def run_names(self):
        """The names a Session call fetches: the fetched tensors', then the targets'."""
        return [t.name for t in self.fetch_tensors] + [op.name for op in self.targets]

    def ops(self):
        """The ops the request fetches from, runs or feeds."""
        return [t.op for t in self.fetch_tensors] + list(self.targets) + \
            [t.op for t in self.feeds]

    def feed_shapes(self):
        return {t.name: v.shape for t, v in self.feeds.items()}

    def feed_values_by_name(self):
        """The values the partitions' runs are fed, each numeric array on a 64-byte
        boundary (`aligned_feed`)."""
        return {t.name: aligned_feed(v) for t, v in self.feeds.items()}

    def build_results(self, session, values_by_name):
        """The fetch structure filled with values, as Session.run returns it."""
        values = [values_by_name[t.name] for t in self.fetch_tensors]
        return self._handler.build_results(session, values)
