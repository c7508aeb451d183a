"""Residence: where a tensor kept on the device waits between two partitions.

A kept transfer leaves its producer's partition as a *ticket* and enters
each reader's partition by that ticket; the executor and the swap manager
only pass tickets along and never look inside.  Two residences exist:

* `SessionHandles` (a local DirectSession): the ticket is a session handle
  (GetSessionHandle / GetSessionTensor / DeleteSessionTensor).  Fastest, and
  each step has its own handles, so steps of one plan may run concurrently.
* `WorkerStaging` (a session on TensorFlow's gRPC runtime, which has no
  session state, so GetSessionHandle fails there): the tensor waits in a
  staging area (MapStage) on the device that produced it, in that task's
  resource manager, under an integer key of its own step; the ticket is
  the key.  Readers peek; the last reader unstages, which frees it.  Each
  step feeds a fresh key base to the partitions and uploads that stage, so
  steps of one plan may run concurrently too (see `StepKeys`).

    producer partition                  reader partitions
    t -> MapStage(key base+k)  ..  MapPeek(key) -> ...   MapUnstage(key) -> ...  (freed)

A residence is asked, while a partition is copied into the graph, for the
ops that keep an output (`keep`) and read an input (`read`); the executor
asks it for the upload callables of swapped tensors (`upload_options`) and,
when a step fails, to drop what the step still holds (`release`).  Per step,
`for_step()` gives what that step feeds (`inputs`, `bind`) and releases.
Measured against fetching every kept tensor to the client and feeding it
back: see experiments/distributed.py --residence.
"""

import functools
import itertools
import logging
import threading
import uuid

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmem.errors import TFMemError
from tfmem.run.front_end.remote import is_distributed, reachable, target_of
from tfmem.run.compiling.rewrite import clean_context
from tfmem import tf_private

log = logging.getLogger(__name__)

# tfmem's own calls on a distributed session (uploads, emptying the staging areas
# after a failed step) get a deadline on the master's side, so a lost parameter
# server cannot hold them forever.  (The client's wait for a master that died is
# bounded only by the session's ConfigProto.operation_timeout_in_ms: see remote.)
UPLOAD_DEADLINE_MS = 120_000
RELEASE_DEADLINE_MS = 10_000


def _with_deadline(options, milliseconds):
    options.run_options.timeout_in_ms = milliseconds
    return options


def for_session(session, device):
    """The session-wide residence: staging on a distributed session, else handles."""
    if is_distributed(session):
        return WorkerStaging(session, device)
    return SessionHandles(session, device)


def _upload_copy(device, host):
    """A copy the device's allocator owns (on a CPU "device" the fed buffer would be used
    in place, so DeepCopy makes the upload a real allocation, as on a GPU)."""
    return tf.raw_ops.DeepCopy(x=host) if device.startswith("CPU") else tf.identity(host)


class SessionHandles:
    """Kept tensors as session handles; one object serves every plan of a session."""

    step_feeds = ()  # (placeholder, source) pairs a partition that keeps tensors feeds

    def __init__(self, session, device):
        self._session = session
        self._device = device  # "GPU:0", or "CPU:0" on an emulated accelerator
        self._uploads = {}  # tuple of dtypes -> CallableOptions, shared by all plans
        self._delete = None

    def for_plan(self, scope):  # pylint: disable=unused-argument
        return self

    def for_step(self):
        """Every step's handles are its own: one object serves every step."""
        return self

    @staticmethod
    def inputs(feeds):
        return feeds

    @staticmethod
    def bind(batches):
        return batches

    def produced(self, name, tensor):
        """Noted for every output of a partition; handles need nothing."""

    def keep(self, graph, name, tensor, key):  # pylint: disable=unused-argument
        with graph.colocate_with(tensor.op):
            return tf.raw_ops.GetSessionHandle(value=tensor)

    def read(self, graph, name, info, key, frees, stem):  # pylint: disable=unused-argument
        """(value, ticket placeholder, op to run after the read or None)."""
        holder = tf.compat.v1.placeholder(tf.string, [], name=f"{stem}_handle")
        value = tf.raw_ops.GetSessionTensor(handle=holder, dtype=info.dtype, name=f"{stem}_read")
        deleter = None
        if frees:
            with graph.control_dependencies([value.op]):
                deleter = tf.raw_ops.DeleteSessionTensor(handle=holder)
        return value, holder, deleter

    def upload_options(self, keys, dtypes):  # pylint: disable=unused-argument
        """CallableOptions that upload arrays of `dtypes` and fetch their handles.

        Make these before any callable of the plan: new ops extend the graph.
        """
        dtypes = tuple(dtypes)
        if dtypes not in self._uploads:
            graph = self._session.graph
            feeds, fetches = [], []
            with clean_context(graph), graph.name_scope("tfmem/upload/"), \
                    graph.device("/device:" + self._device):
                for dtype in dtypes:
                    host = tf.compat.v1.placeholder(dtype, None, name="host")
                    feeds.append(host.name)
                    fetches.append(tf.raw_ops.GetSessionHandle(
                        value=_upload_copy(self._device, host)).name)
            self._uploads[dtypes] = config_pb2.CallableOptions(feed=feeds, fetch=fetches)
        return self._uploads[dtypes]

    def release(self, tickets):
        """Delete the handles of a step that did not finish."""
        if not tickets:
            return
        if self._delete is None:
            graph = self._session.graph
            with clean_context(graph), graph.name_scope("tfmem/release/"):
                holder = tf.compat.v1.placeholder(tf.string, [], name="handle")
                op = tf.raw_ops.DeleteSessionTensor(handle=holder)
            self._delete = tf_private.make_callable(
                self._session, config_pb2.CallableOptions(feed=[holder.name], target=[op.name]))
        for handle in tickets:
            try:
                self._delete(handle)
            except tf.errors.OpError:
                pass  # already deleted in-graph by the partition that failed


class WorkerStaging:
    """Kept tensors in staging areas of the tasks that produced them (gRPC sessions).

    Session-wide: names the areas of this process uniquely, so that two clients of
    one worker, or two plans of one session, never share an area.
    """

    def __init__(self, session, device):
        self._session = session
        self._device = device
        self._prefix = f"tfmem_{uuid.uuid4().hex[:12]}"
        self._plans = itertools.count()

    def for_plan(self, scope):  # pylint: disable=unused-argument
        return PlanStaging(self._session, self._device, f"{self._prefix}_{next(self._plans)}")


STEP_KEY = "tfmem:step_key"  # the feed source of a step's key base (see StepKeys)
KEYS_PER_STEP = 1 << 20  # a plan stages at most this many device copies per step


class PlanStaging:
    """The staging areas of one plan: one per dtype, one key offset per device copy.

    A step's key of a device copy is the step's base (fed) plus the copy's offset,
    so concurrent steps of the plan never share a key.  Each key has a release op
    that stages a placeholder value at it and unstages it: that removes what the
    key held, or nothing, without waiting (MapUnstage of an absent key waits, and
    a second MapStage at a key leaves the first tensor: checked on TF 2.21).  A
    failed step runs the release of every key of its own base and touches no
    other step's tensors.
    """

    def __init__(self, session, device, name):
        self._session = session
        self._device = device
        self._name = name
        self._keys = {}  # (tensor, first reader) -> int key offset
        self._homes = {}  # tensor -> the op its device copies are colocated with
        self._base = None  # the step's key base, fed to every call that stages
        self._releases = []  # per key: the op removing what a step staged there
        self._release_call = None
        self._steps = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def step_feeds(self):
        return ((self._base_of(self._session.graph).name, STEP_KEY),)

    def _base_of(self, graph):
        if self._base is None:
            with clean_context(graph), graph.name_scope(f"tfmem/steps_{self._name}/"):
                self._base = tf.compat.v1.placeholder(tf.int64, [], name="step_key")
        return self._base

    def _area(self, dtype):
        return f"{self._name}_{tf.as_dtype(dtype).name}"

    def _offset(self, key):
        if key not in self._keys and len(self._keys) >= KEYS_PER_STEP:
            raise TFMemError(f"a plan stages more than {KEYS_PER_STEP} device copies per "
                             "step on a distributed session; use a larger partition_size")
        return self._keys.setdefault(key, len(self._keys))

    def _stage(self, graph, tensor, home, key):
        """Stage `tensor` at the step's `key`, colocated with `home`; return the ticket."""
        dtype = tensor.dtype.base_dtype
        base = self._base_of(graph)
        with graph.colocate_with(base.op):  # key arithmetic stays on the host
            number = tf.math.add(base, tf.constant(self._offset(key), tf.int64), name="key")
        with graph.colocate_with(home):
            stage = tf.raw_ops.MapStage(key=number, indices=[0], values=[tensor],
                                        dtypes=[dtype], shared_name=self._area(dtype),
                                        name="stage")
        with clean_context(graph), graph.name_scope(f"tfmem/release_{self._name}/"), \
                graph.colocate_with(home):
            self._releases.append(_remove_op(number, dtype, self._area(dtype)).name)
        with graph.colocate_with(base.op), graph.control_dependencies([stage]):
            return tf.identity(number, name="ticket")

    def produced(self, name, tensor):
        """Every partition output: its uploads are colocated with its producer."""
        self._homes[name] = tensor.op

    def keep(self, graph, name, tensor, key):
        return self._stage(graph, tensor, tensor.op, key)

    def read(self, graph, name, info, key, frees, stem):
        with graph.colocate_with(self._homes[name]):
            holder = tf.compat.v1.placeholder(tf.int64, [], name=f"{stem}_key")
            fetch = tf.raw_ops.MapUnstage if frees else tf.raw_ops.MapPeek
            value = fetch(key=holder, indices=[0], dtypes=[info.dtype],
                          shared_name=self._area(info.dtype), name=f"{stem}_read")[0]
        return value, holder, None

    def upload_options(self, keys, dtypes):
        """CallableOptions that stage host arrays at `keys` and fetch their tickets; the
        step's key base is fed first (see StepKeys.bind)."""
        graph = self._session.graph
        feeds, fetches = [self._base_of(graph).name], []
        with clean_context(graph), graph.name_scope(f"tfmem/upload_{self._name}/"):
            for key, dtype in zip(keys, dtypes):
                home = self._homes[key[0]]
                with graph.colocate_with(home):
                    host = tf.compat.v1.placeholder(dtype, None, name="host")
                    copy = _upload_copy(self._device, host)
                feeds.append(host.name)
                fetches.append(self._stage(graph, copy, home, key).name)
        return _with_deadline(config_pb2.CallableOptions(feed=feeds, fetch=fetches),
                              UPLOAD_DEADLINE_MS)

    def for_step(self):
        """The keys of a new step."""
        return StepKeys(self, next(self._steps) * KEYS_PER_STEP)

    def release(self, base, tickets):
        """Remove whatever the step of key `base` still has staged, and nothing else."""
        if not self._releases:
            return
        if not reachable(target_of(self._session)):
            log.warning("the session's master %s is gone: %d staged tensors were not "
                        "released (those on its own task went with it)",
                        target_of(self._session), len(tickets))
            return
        with self._lock:
            if self._release_call is None:
                self._release_call = tf_private.make_callable(
                    self._session, _with_deadline(config_pb2.CallableOptions(
                        feed=[self._base.name], target=self._releases), RELEASE_DEADLINE_MS))
        try:
            self._release_call(np.int64(base))
        except tf.errors.OpError as err:
            log.warning("could not remove a failed step's staged tensors (%d tickets): %s",
                        len(tickets), err.message.splitlines()[0])


def _placeholder_value(dtype):
    """A small value of `dtype` to stage where a step's tensor may be."""
    if dtype == tf.variant:
        return tf.raw_ops.EmptyTensorList(element_shape=tf.constant(-1, tf.int32),
                                          max_num_elements=-1, element_dtype=tf.float32)
    return tf.zeros([0], dtype)


def _remove_op(key, dtype, area):
    """Stage a placeholder value at `key`, then unstage the key: whatever it held is gone."""
    stage = tf.raw_ops.MapStage(key=key, indices=[0], values=[_placeholder_value(dtype)],
                                dtypes=[dtype], shared_name=area, name="fill")
    with tf.control_dependencies([stage]):
        return tf.raw_ops.MapUnstage(key=key, indices=[0], dtypes=[dtype], shared_name=area,
                                     name="remove")[0].op


class StepKeys:
    """One step's staging keys: its base, fed to the calls that stage, and its release."""

    def __init__(self, staging, base):
        self._staging = staging
        self.base = base
        self._fed = np.int64(base)

    def inputs(self, feeds):
        """The step's feeds by source name, with its key base."""
        return {**feeds, STEP_KEY: self._fed}

    def bind(self, batches):
        """The plan's upload callables, fed this step's key base first."""
        return {index: functools.partial(batch, self._fed) for index, batch in batches.items()}

    def release(self, tickets):
        self._staging.release(self.base, tickets)
