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
  resource manager, under an integer key fixed per device copy; the ticket
  is the key.  Readers peek; the last reader unstages, which frees it.
  Keys are fixed per plan, so steps of one plan run one at a time (see
  `PlanStaging.serial_steps` for why, and what lifting that would take).

    producer partition         reader partitions
    t -> MapStage(key k)  ..  MapPeek(k) -> ...   MapUnstage(k) -> ...  (freed)

A residence is asked, while a partition is copied into the graph, for the
ops that keep an output (`keep`) and read an input (`read`); the executor
asks it for the upload callables of swapped tensors (`upload_options`) and,
when a step fails, to drop what the step still holds (`release`).
Measured against fetching every kept tensor to the client and feeding it
back: see experiments/distributed.py --residence.
"""

import itertools
import logging
import threading
import uuid

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmem.run.remote import is_distributed, reachable, target_of
from tfmem.run.rewrite import clean_context
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

    serial_steps = False

    def __init__(self, session, device):
        self._session = session
        self._device = device  # "GPU:0", or "CPU:0" on an emulated accelerator
        self._uploads = {}  # tuple of dtypes -> CallableOptions, shared by all plans
        self._delete = None

    def for_plan(self, scope):  # pylint: disable=unused-argument
        return self

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


class PlanStaging:
    """The staging areas of one plan: one per dtype, one key per device copy."""

    # Steps of one plan run one at a time (the executor holds a lock), for two reasons:
    # * keys are constants of the plan's graph, so two steps at once would stage
    #   different tensors at one key of one area, and MapStage at a key already there
    #   does not fail (checked on TF 2.21: the area still holds one tensor): a reader
    #   gets the other step's tensor, or waits for a key another step unstaged (with
    #   this lock off, three threads running one plan all ended in DeadlineExceeded:
    #   tests/test_distributed.py, check_concurrent_steps_of_one_plan_equal_plain);
    # * a failed step empties the plan's areas (MapClear), which would drop what a
    #   concurrent step staged, and its readers would wait in MapPeek to the deadline.
    # Lifting it takes per-step keys (a key base fed to every partition and upload
    # that stages, added to the fixed key; tickets already carry keys to readers) and a
    # release that unstages only the failed step's keys: a new feed in rewrite and in
    # the prefetcher's upload callables, beyond this module.  Other plans still overlap.
    serial_steps = True

    def __init__(self, session, device, name):
        self._session = session
        self._device = device
        self._name = name
        self._keys = {}  # (tensor, first reader) -> int key
        self._homes = {}  # tensor -> the op its device copies are colocated with
        self._clears = []  # ops that empty the plan's areas, one per home and dtype
        self._cleared = set()
        self._clear_call = None
        self._lock = threading.Lock()

    def _area(self, dtype):
        return f"{self._name}_{tf.as_dtype(dtype).name}"

    def _key(self, key):
        return self._keys.setdefault(key, len(self._keys))

    def _stage(self, graph, tensor, home, key):
        """Stage `tensor` at `key`, colocated with `home`; return the ticket (the key)."""
        dtype = tensor.dtype.base_dtype
        with graph.colocate_with(home):
            number = tf.constant(self._key(key), tf.int64, name="key")
            stage = tf.raw_ops.MapStage(key=number, indices=[0], values=[tensor],
                                        dtypes=[dtype], shared_name=self._area(dtype),
                                        name="stage")
            if (home.name, dtype) not in self._cleared:
                self._cleared.add((home.name, dtype))
                with clean_context(graph), graph.name_scope("tfmem/release/"), \
                        graph.colocate_with(home):
                    self._clears.append(tf.raw_ops.MapClear(
                        dtypes=[dtype], shared_name=self._area(dtype)).name)
            with graph.control_dependencies([stage]):
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
        """CallableOptions that stage host arrays at `keys` and fetch their tickets."""
        graph = self._session.graph
        feeds, fetches = [], []
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

    def release(self, tickets):
        """Empty the plan's areas after a failed step (steps of a plan never overlap)."""
        if not self._clears:
            return
        if not reachable(target_of(self._session)):
            log.warning("the session's master %s is gone: %d staged tensors were not "
                        "released (those on its own task went with it)",
                        target_of(self._session), len(tickets))
            return
        with self._lock:
            if self._clear_call is None:
                self._clear_call = tf_private.make_callable(
                    self._session, _with_deadline(config_pb2.CallableOptions(target=self._clears),
                                                  RELEASE_DEADLINE_MS))
        try:
            self._clear_call()
        except tf.errors.OpError as err:
            log.warning("could not empty tfmem's staging areas after a failed step "
                        "(%d tensors): %s", len(tickets), err.message.splitlines()[0])
