"""``tfmem plan``: plan a saved graph's request and predict its memory, without running it.

    tfmem plan model.meta --fetch train --fetch loss:0 --feed-shape x=512,64 \\
        --partition-size 50 --json plan.json --plot memory.png --trace step.json

The command loads a MetaGraph or GraphDef into a fresh graph, resolves the
names it is given (fetches, fed placeholders and their shapes), and runs the
same pipeline `TFMemSession` runs before its first step:

    model -> graph -> analyse / place / partition / plan (make_plan, or
                      budget.fit to find a partition size within --budget)
                   -> resolve_shapes (feed shapes fix unknown dimensions)
                   -> scratch.calibrate (each distinct kernel once, alone)
                   -> simulate -> summary table, JSON, plot, Chrome trace

The model's step never runs: the memory figures are the simulator's
predictions, kernel scratch included (each distinct kernel configuration runs
once on zeros in a scratch session to measure it), and the trace's times are
nominal (1 ms per op).  Measured per-partition peaks of a real step are in
`TFMemSession.memory_report()`.

Exit status: 0 when a plan was made; 1 when tfmem cannot plan the request (no
partition size fits the budget, a graph construct it cannot partition); 2 for
a bad command line (a model that does not load, an unknown name, a missing
feed, a bad size).  Errors are one message on stderr, never a traceback.
"""

import argparse
import difflib
import json
import os
import re
import sys

from tfmem.run.measuring import report_text
from tfmem.run.measuring.trace import TRACKS
from tfmem.cli.arguments import positive_int
from tfmem.memory import op_order
from tfmem.memory.sizes import mib
from tfmem.plan import optypes, stretches

MS_PER_OP = 1e-3  # nominal duration of one op in the planned trace, in seconds
DEFAULT_PARTITION_SIZE = 200  # TFMemSession's default
ACCEPTED = ("a MetaGraph (.meta, as written by tf.compat.v1.train.export_meta_graph or "
            "next to a checkpoint), a binary GraphDef (.pb) or a text GraphDef (.pbtxt)")

DESCRIPTION = """\
Plan one request of a saved graph the way TFMemSession would run it, and
predict its memory, without running the step: load MODEL, cut what the
fetches need into partitions, decide for every tensor that crosses a
partition whether it stays on the device or waits in host memory, and
simulate the device and host bytes of one step (kernel scratch measured once
per distinct kernel on zeros). Prints a table per partition
and totals; optionally writes the plan as JSON, a plot of the memory, and a
Chrome trace of the planned step."""

EPILOG = """\
MODEL is a MetaGraph (.meta; devices are cleared), a binary GraphDef (.pb) or
a text GraphDef (.pbtxt).

--fetch takes op names (run as targets, like a train op) and tensor names
("loss:0", fetched). --feed-shape declares a fed tensor (placeholder) and its
concrete shape, e.g. x=512,64 (x= for a scalar; just x when its static shape is
fully known); every placeholder the fetches need must be fed. Sizes (--budget,
--swap-min-bytes) are bytes or a number with a unit: 512MiB, 2GiB, 1.5GB.

--budget SIZE replaces --partition-size (default 200): the largest partition
size (in auto mode also the longest swap distance up to --swap-distance)
whose predicted device peak fits SIZE, less a safety margin, is chosen; exit
status 1 names the largest op when nothing fits.

--inter-op-threads N is the inter-op threads of the session that will run
the step (default 0, TensorFlow's default: TF_NUM_INTEROP_THREADS, else one
per usable core of this machine). On a CPU its executor may run that many
ready ops at once, so each kernel's scratch is predicted together with that
of the largest N-1 others of its partition that could run beside it; where
TensorFlow finds a GPU, which runs one kernel at a time, N does not matter.
Pass the session's own setting (1 for one kernel at a time). Partitions whose
copies TFMemSession chains (most: see op_order.chained_order) run one kernel
at a time whatever N.  --unchained plans for a TFMemSession made with
options=tfmem.Options(chain_copies=False), whose copies TensorFlow's executor
orders.

--trace writes the PLANNED step as a Chrome trace (chrome://tracing,
ui.perfetto.dev) on the tracks partitions, swap-out, prefetch and wait. Its
times are nominal, not measured (nothing runs): each partition lasts 1 ms per
op, in plan order; a swap-out is an instant at the end of its producer; an
upload batch spans the partition during which the prefetcher uploads it; a
wait is an instant where a reader first takes an uploaded copy. Args carry
the predicted bytes. For a measured trace, pass trace=PATH to TFMemSession.

Exit status: 0 planned; 1 tfmem cannot plan the request (nothing fits the
budget, an unsupported graph construct); 2 bad arguments or a model that does
not load."""


class UsageError(Exception):
    """A bad model, name, shape or output path: reported in one line, exit status 2."""


# --------------------------------------------------------------------------
# arguments


def _nonnegative_int(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def parse_size(text, flag, minimum=1):
    """Bytes of a size such as '2GiB' (budget.parse_bytes), at least `minimum`; else UsageError."""
    from tfmem.memory.budget import parse_bytes  # pylint: disable=import-outside-toplevel
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if value < minimum:
        raise UsageError(f"{flag}: must be a positive size, got {text!r}")
    return value


def _feed_shape(text):
    """'NAME=D1,D2' -> (NAME, (D1, D2)); 'NAME=' -> a scalar; 'NAME' -> its static shape."""
    name, has_dims, dims = text.partition("=")
    name = name.strip()
    if not name:
        raise argparse.ArgumentTypeError(f"expected NAME=D1,D2,..., got {text!r}")
    if not has_dims:
        return name, None
    shape = []
    for dim in (d.strip() for d in dims.split(",")) if dims.strip() else ():
        if not dim.isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r}: dimension {dim!r} is not a size (an integer >= 0); a feed "
                "shape is concrete, e.g. x=512,64")
        shape.append(int(dim))
    return name, tuple(shape)


def add_arguments(parser):
    """Add the options of ``tfmem plan`` to `parser` (imports no TensorFlow)."""
    parser.add_argument("model", metavar="MODEL",
                        help="the graph: a MetaGraph (.meta) or a GraphDef (.pb binary, "
                             ".pbtxt text)")
    parser.add_argument("--fetch", action="append", required=True, metavar="NAME",
                        help="an op to run (op name) or a tensor to fetch ('name:0'); repeat "
                             "for several")
    parser.add_argument("--feed-shape", action="append", type=_feed_shape, default=[],
                        metavar="NAME=D1,D2,...",
                        help="a fed placeholder and its concrete shape; repeat for each")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--partition-size", type=positive_int, metavar="N",
                      help=f"the most ops per partition (default: {DEFAULT_PARTITION_SIZE})")
    size.add_argument("--budget", metavar="SIZE",
                      help="device memory to fit: tfmem.memory.budget searches the largest "
                           "partition size whose predicted peak fits, with a safety margin "
                           "(e.g. 2GiB, 512MiB, 1.5GB, or bytes)")
    parser.add_argument("--swap", choices=("auto", "all", "none"), default="auto",
                        help="which cross-partition tensors wait in host memory (default: auto)")
    parser.add_argument("--swap-distance", type=_nonnegative_int, default=2, metavar="N",
                        help="auto: keep a tensor on the device when its next reader is at "
                             "most N partitions away (default: 2)")
    parser.add_argument("--prefetch", type=_nonnegative_int, default=1, metavar="N",
                        help="upload swapped tensors N partitions before their reader "
                             "(default: 1)")
    parser.add_argument("--swap-min-bytes", default="1MiB", metavar="SIZE",
                        help="auto: tensors smaller than SIZE stay on the device "
                             "(default: 1MiB)")
    parser.add_argument("--inter-op-threads", type=_nonnegative_int, default=0, metavar="N",
                        help="the running session's inter-op threads: on a CPU, that many "
                             "kernels may hold scratch at once (default: 0, TensorFlow's "
                             "default, one per usable core)")
    parser.add_argument("--unchained", action="store_true",
                        help="as a TFMemSession with Options(chain_copies=False) runs it: "
                             "TensorFlow's executor orders each partition's copies")
    parser.add_argument("--json", metavar="OUT.json",
                        help="write the plan and its predicted memory as JSON")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="plot the predicted device and host memory per partition "
                             "(needs matplotlib: pip install 'tfmem[plot]')")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="write a Chrome trace of the planned step (nominal times: 1 ms "
                             "per op; nothing runs)")


# --------------------------------------------------------------------------
# loading and names


def _suggest(name, candidates):
    """'; did you mean ...' with the candidates closest to `name`, or ''."""
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    tail = name.rsplit("/", 1)[-1].split(":")[0]
    close += [c for c in candidates if c not in close and
              c.rsplit("/", 1)[-1].split(":")[0] == tail][:5 - len(close)]
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def _parse_proto(data, attempts):
    """The first (proto class, 'binary'|'text') in `attempts` that parses `data`, or None."""
    from google.protobuf import message, text_format  # pylint: disable=import-outside-toplevel
    for proto_class, form in attempts:
        proto = proto_class()
        try:
            if form == "binary":
                proto.ParseFromString(data)
            else:
                text_format.Parse(data.decode("utf-8"), proto)
        except (message.DecodeError, text_format.ParseError, UnicodeDecodeError, ValueError):
            continue
        return proto
    return None


def load_graph(path):
    """A fresh tf.Graph with the MetaGraph or GraphDef at `path`; UsageError if it does not load."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import meta_graph_pb2  # pylint: disable=import-outside-toplevel

    def fail(what):
        raise UsageError(f"cannot load model '{path}': {what}. MODEL must be {ACCEPTED}")

    if not os.path.exists(path):
        fail("no such file")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "saved_model.pb")):
            fail("it is a SavedModel directory, which tfmem plan does not read; export its "
                 "graph with tf.compat.v1.train.export_meta_graph")
        fail("it is a directory")
    extension = os.path.splitext(path)[1].lower()
    meta, graph_def = meta_graph_pb2.MetaGraphDef, graph_pb2.GraphDef
    attempts = {".meta": [(meta, "binary"), (meta, "text")],
                ".pb": [(graph_def, "binary"), (graph_def, "text")],
                ".pbtxt": [(graph_def, "text"), (meta, "text")]}.get(extension)
    if attempts is None:
        fail(f"unrecognised file extension {extension or '(none)'!r}")
    try:
        with open(path, "rb") as source:
            data = source.read()
    except OSError as exc:
        fail(exc.strerror or str(exc))
    proto = _parse_proto(data, attempts)
    expected = "MetaGraphDef" if extension == ".meta" else "GraphDef"
    if proto is None:
        fail(f"it is not a {expected} protocol buffer (neither binary nor text format parses)")
    is_meta = isinstance(proto, meta)
    nodes = proto.graph_def.node if is_meta else proto.node
    if not nodes:
        fail(f"it parses as a {type(proto).__name__} with no ops (an empty or foreign file)")
    graph = tf.Graph()
    try:
        with graph.as_default():
            if is_meta:
                tf.compat.v1.train.import_meta_graph(proto, clear_devices=True)
            else:
                tf.graph_util.import_graph_def(proto, name="")
    except Exception as exc:  # pylint: disable=broad-except  # any import failure is a bad model
        reason = (str(exc).strip().splitlines() or [""])[0]
        fail(f"TensorFlow cannot import it ({type(exc).__name__}: {reason})")
    return graph


def _tensor_names(graph):
    return [t.name for op in graph.get_operations() for t in op.outputs]


def _find_tensor(graph, name, what):
    try:
        return graph.get_tensor_by_name(name)
    except (KeyError, ValueError, TypeError):
        pass
    op_name, _, index = name.rpartition(":")
    try:
        op = graph.get_operation_by_name(op_name)
    except (KeyError, ValueError):
        op = None
    if op is not None:
        outputs = ", ".join(t.name for t in op.outputs) or "none"
        raise UsageError(f"{what} '{name}': op '{op_name}' has no output {index!r} "
                         f"(its outputs: {outputs})")
    raise UsageError(f"{what} '{name}': no tensor of that name in the graph"
                     + _suggest(name, _tensor_names(graph)))


def resolve_fetches(graph, names):
    """(fetch tensors, target ops) named on the command line."""
    tensors, ops = [], []
    for name in dict.fromkeys(names):
        if ":" in name:
            tensors.append(_find_tensor(graph, name, "--fetch"))
            continue
        try:
            ops.append(graph.get_operation_by_name(name))
        except (KeyError, ValueError):
            raise UsageError(f"--fetch '{name}': no op of that name in the graph"
                             + _suggest(name, [op.name for op in graph.get_operations()])) \
                from None
    return tensors, ops


def _shape_text(shape):
    return "<unknown>" if shape.rank is None else \
        "[" + ",".join("?" if d is None else str(d) for d in shape.as_list()) + "]"


def resolve_feeds(graph, specs):
    """{fed tensor name: concrete shape} from --feed-shape (name, dims or None) pairs."""
    placeholders = [op.name for op in graph.get_operations() if op.type in optypes.FEEDABLE_PLACEHOLDERS]
    feeds = {}
    for name, dims in specs:
        if ":" in name:
            tensor = _find_tensor(graph, name, "--feed-shape")
        else:
            try:
                op = graph.get_operation_by_name(name)
            except (KeyError, ValueError):
                hint = _suggest(name, placeholders) or _suggest(
                    name, [op.name for op in graph.get_operations()])
                listing = (f" (placeholders in the graph: {', '.join(placeholders)})"
                           if placeholders and len(placeholders) <= 10 else "")
                raise UsageError(f"--feed-shape '{name}': no placeholder of that name in the "
                                 f"graph{hint}{listing}") from None
            if len(op.outputs) != 1:
                raise UsageError(f"--feed-shape '{name}': op '{name}' ({op.type}) has "
                                 f"{len(op.outputs)} outputs; name the tensor, e.g. '{name}:0'")
            tensor = op.outputs[0]
        if not graph.is_feedable(tensor):
            raise UsageError(f"--feed-shape '{name}': tensor '{tensor.name}' may not be fed")
        if dims is None:
            if not tensor.shape.is_fully_defined():
                raise UsageError(
                    f"--feed-shape '{name}': give a concrete shape, its static shape "
                    f"{_shape_text(tensor.shape)} has unknown dimensions "
                    f"(e.g. --feed-shape {name}={_shape_text(tensor.shape)[1:-1]} with each "
                    "? replaced by a size)")
            dims = tuple(tensor.shape.as_list())
        if not tensor.shape.is_compatible_with(dims):
            raise UsageError(f"--feed-shape '{name}': cannot feed shape "
                             f"[{','.join(map(str, dims))}] for tensor '{tensor.name}', which "
                             f"has shape {_shape_text(tensor.shape)}")
        if feeds.get(tensor.name, dims) != dims:
            raise UsageError(f"--feed-shape: '{tensor.name}' is given two shapes, "
                             f"{list(feeds[tensor.name])} and {list(dims)}")
        feeds[tensor.name] = tuple(dims)
    return feeds


def _check_feeds(fetch_tensors, target_ops, fed_tensors, chained):
    """The request's GraphView, `chained` as TFMemSession would chain it; UsageError naming
    every placeholder it needs but is not fed."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.plan.analyse import analyse  # pylint: disable=import-outside-toplevel
    fed, missing, first = list(fed_tensors), [], None
    while True:
        try:
            view = analyse(fetch_tensors, target_ops, fed, chained=chained)
            break
        except tf.errors.InvalidArgumentError as exc:
            op = exc.op
            if op is None or not op.outputs or op.outputs[0].name in {t.name for t in fed}:
                raise
            first = first or exc.message
            missing.append(op)
            fed.append(op.outputs[0])
    if missing:
        names = ", ".join(f"'{op.name}' ({op.outputs[0].dtype.name}, shape "
                          f"{_shape_text(op.outputs[0].shape)})" for op in missing)
        example = " ".join(f"--feed-shape {op.name}={_shape_text(op.outputs[0].shape)[1:-1]}"
                           if op.outputs[0].shape.rank is not None else
                           f"--feed-shape {op.name}=D1,D2,..." for op in missing)
        raise UsageError(
            f"the fetches need {len(missing)} placeholder(s) that are not fed: {names} "
            f"(Session.run would raise: {first}). Feed each with its concrete shape: "
            f"{example} (replace each ? by a size)")
    return view


def _shape_failure(message):
    """TensorFlow's shape-inference error from resolve_shapes, in the user's op names."""
    message = (message.strip().splitlines() or [""])[0]
    op = re.search(r"\{\{node s/([^}]+)\}\}", message)
    shapes = re.search(r"with input shapes: (.*?)\.?$", message)
    if not op:
        return message
    reason = message.split(" for '{{node")[0]
    return f"op '{op.group(1)}': {reason}" + (
        f" (input shapes {shapes.group(1)})" if shapes else "")


def _check_output(path, flag):
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} '{path}': directory '{folder}' does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{flag} '{path}' is a directory; give a file name")


# --------------------------------------------------------------------------
# reports


def tensor_bytes(plan, shapes):
    """{transfer tensor: predicted bytes (0 when unknown)}, sized as the simulator sizes them."""
    from tfmem.memory.simulate import TensorSizes  # pylint: disable=import-outside-toplevel
    size = TensorSizes(plan.view, shapes)
    return {transfer.tensor: size(transfer.tensor) for transfer in plan.transfers}


def planned_events(plan, trace, nbytes):
    """Chrome trace events (track, name, start_s, end_s, args) of the planned step.

    Nominal times: partition i runs for 1 ms per op, right after i-1.  Each
    swapped transfer is an instant "swap-out" at the end of its producer; the
    uploads whose span starts in partition i are one "prefetch" event over
    partition i (the prefetcher uploads them in one batch while it runs);
    each reader that first takes an uploaded copy "wait"s for it at its start.
    `nbytes` maps transfer tensors to bytes.
    """
    starts, ends, clock = [], [], 0.0
    for partition in plan.partitions:
        starts.append(clock)
        clock += len(partition.ops) * MS_PER_OP
        ends.append(clock)
    memory = {m.index: m for m in trace.partitions} if trace is not None else {}
    events = []
    for partition in plan.partitions:
        i = partition.index
        args = {"ops": len(partition.ops), "inputs": len(partition.inputs),
                "outputs": len(partition.outputs)}
        if i in memory:
            m = memory[i]
            args.update(device_before_bytes=m.device_before, device_peak_bytes=m.device_peak,
                        device_peak_chunks_bytes=m.device_peak_chunks,
                        kernel_scratch_bytes=m.scratch,
                        device_after_bytes=m.device_after, host_bytes=m.host_after,
                        bytes_to_host=m.to_host, bytes_to_device=m.to_device)
        events.append(("partitions", f"partition {i}", starts[i], ends[i], args))
    for transfer in plan.transfers:
        if transfer.swapped:
            end = ends[transfer.producer]
            events.append(("swap-out", transfer.tensor, end, end,
                           {"bytes": nbytes.get(transfer.tensor, 0),
                            "producer": transfer.producer,
                            "readers": list(transfer.consumers)}))
    for partition in plan.partitions:
        i = partition.index
        batch = [(transfer, span)
                 for transfer in map(plan.transfer, dict.fromkeys(partition.uploads))
                 for span in transfer.spans if span.uploaded and span.start == i]
        if batch:
            events.append(("prefetch", f"uploads during partition {i}", starts[i], ends[i], {
                "tensors": [t.tensor for t, _ in batch],
                "bytes": sum(nbytes.get(t.tensor, 0) for t, _ in batch),
                "first_readers": [span.readers[0] for _, span in batch]}))
    for transfer in plan.transfers:
        for span in transfer.spans:
            if span.uploaded:
                reader = span.readers[0]
                events.append(("wait", transfer.tensor, starts[reader], starts[reader], {
                    "bytes": nbytes.get(transfer.tensor, 0), "uploaded_during": span.start,
                    "partitions_ahead": reader - span.start}))
    events.sort(key=lambda event: (event[2], TRACKS.index(event[0])))
    return events


def _human(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _band_text(trace, budget):
    """Where TensorFlow's measured peak is expected: between the two predicted figures."""
    low, high = report_text.band(trace.peak_device, trace.peak_device_chunks)
    text = (f"{mib(low, 2, unit=False)}-{mib(high, 2, unit=False)} MiB: TensorFlow's measured "
            "peak usually lies between the requested and the chunk figure, and varies from "
            "process to process for one plan (docs/results.md, Simulator accuracy)")
    if budget is not None:
        text += ("; fitted to a budget, the requested figure is budget mode's bound (the "
                 "larger figure plus an allowance for chunks)")
    return text


def _served_lines(trace):
    """Whether the chunk replay served every request within the device's limit (when
    the device's limit is known: the emulated accelerator)."""
    regions = trace.regions
    if regions.limit is None:
        return []
    within = mib(regions.limit, 2) + (f" less {mib(regions.occupied, 2)} held back"
                                      if regions.occupied else "")
    unserved = [m.index for m in trace.partitions if not m.served]
    if not unserved:
        return [f"within the device:     the replay serves every request within {within}"]
    return [f"within the device:     NOT SERVED: a request of partition(s) "
            f"{', '.join(map(str, unserved[:5]))}{' ...' if len(unserved) > 5 else ''} "
            f"finds no chunk within {within} (TensorFlow would run out of memory)"]


def _calls_text(plan):
    """How many callables a local session runs the plan in, and which partitions each runs."""
    groups = stretches.stretches(plan)
    ranges = ", ".join(f"{g[0]}" if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups[:8])
    more = ", ..." if len(groups) > 8 else ""
    return (f"{len(groups)} (one per stretch of partitions with nothing swapped between "
            f"them, on a local session: {ranges}{more})")


def _kernels_text(plan, kernels):
    """How many kernels the prediction holds at once: `kernels` where TensorFlow's
    executor orders a partition, one where TFMemSession chains its copies."""
    chained = sum(op_order.is_chained(plan.view, p.ops) for p in plan.partitions)
    free = len(plan.partitions) - chained
    if kernels == 1 or free == len(plan.partitions):
        return f"up to {kernels} kernel{'s' if kernels > 1 else ''} at once"
    if not free:
        return "one kernel at a time: every partition's copies are chained"
    return (f"up to {kernels} kernels at once in the {free} partition(s) TensorFlow orders, "
            f"one in the {chained} chained")


def format_summary(plan, trace, model=None, budget=None, kernels=1):
    """The summary table of a plan and its MemoryTrace, as text (`kernels`: how many
    may run at once, as predicted)."""
    policy = plan.policy
    swapped = [t for t in plan.transfers if t.swapped]
    uploads = sum(span.uploaded for t in plan.transfers for span in t.spans)
    head = (f"{model}: " if model else "") + (
        f"{plan.num_ops} ops in {len(plan.partitions)} partitions "
        f"(partition_size={plan.partition_size}"
        + (f", fitted to a budget of {_human(budget)}" if budget is not None else "") + "); "
        f"swap={policy.mode}, swap_distance={policy.swap_distance}, "
        f"prefetch={policy.prefetch}, swap_min_bytes={policy.min_bytes}")
    columns = ("part", "ops", "inputs", "outputs", "swapped out MiB", "uploaded MiB",
               "device peak MiB", "in chunks MiB", "kernel scratch MiB", "host MiB")
    widths = [max(len(c), 6) for c in columns]
    lines = [head, "", "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    memory = {m.index: m for m in trace.partitions}
    for p in plan.partitions:
        m = memory[p.index]
        row = (p.index, len(p.ops), len(p.inputs), len(p.outputs), mib(m.to_host, 2, unit=False),
               mib(m.to_device, 2, unit=False), mib(m.device_peak, 2, unit=False),
               mib(m.device_peak_chunks, 2, unit=False), mib(m.scratch, 2, unit=False),
               mib(m.host_after, 2, unit=False))
        lines.append("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    lines += [
        "",
        f"partitions:            {len(plan.partitions)}",
        f"session calls:         {_calls_text(plan)}",
        f"transfers:             {len(plan.transfers)} ({len(swapped)} swapped to host, "
        f"{len(plan.transfers) - len(swapped)} kept on the device)",
        f"predicted device peak: {mib(trace.peak_device, 2, unit=False)} MiB in partition "
        f"{trace.peak_partition} (state {mib(trace.state_bytes, 2, unit=False)} MiB)",
        f"in allocator chunks:   {mib(trace.peak_device_chunks, 2, unit=False)} MiB "
        f"(the same allocations replayed through TensorFlow's BFC policy)",
        f"predicted band:        {_band_text(trace, budget)}",
        *_served_lines(trace),
        f"largest kernel scratch: {mib(max((m.scratch for m in trace.partitions), default=0), 2, unit=False)} MiB "
        f"(counted in the peaks; {_kernels_text(plan, kernels)})",
        f"predicted host peak:   {mib(trace.peak_host, 2, unit=False)} MiB",
        f"to host:               {mib(trace.bytes_to_host, 2, unit=False)} MiB ({trace.bytes_to_host} bytes) "
        f"in {len(swapped)} swap-outs",
        f"to device:             {mib(trace.bytes_to_device, 2, unit=False)} MiB ({trace.bytes_to_device} "
        f"bytes) in {uploads} uploads",
        str(plan.placement),
    ]
    if trace.unknown_tensors:
        lines.append(f"note: {trace.unknown_tensors} tensors of unknown size count as 0 bytes "
                     "(shapes that depend on values, or dimensions no --feed-shape fixes)")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# the command


def plan_request(graph, fetch_tensors, target_ops, feed_shapes, policy, partition_size=None,
                 budget=None, kernels=1, chain_copies=True):
    """(plan, trace, shapes) of a request, with `partition_size` or fitted to `budget` bytes,
    `kernels` of them at once (see tfmem.memory.concurrency), its copies chained as
    TFMemSession chains them unless `chain_copies` is False (Options.chain_copies).

    Raises UsageError for unfed placeholders and feed shapes the graph rejects,
    and what make_plan / budget.fit raise (TFMemError) when no plan can be made.
    """
    from tfmem.plan.build import make_plan  # pylint: disable=import-outside-toplevel
    from tfmem.memory.simulate import simulate  # pylint: disable=import-outside-toplevel
    from tfmem.memory.sizing import Sizing  # pylint: disable=import-outside-toplevel

    fed_tensors = [graph.get_tensor_by_name(name) for name in feed_shapes]
    # A fetched tensor that is fed is answered from the feed (as Session.run does).
    fetch_tensors = [t for t in fetch_tensors if t.name not in feed_shapes]
    view = _check_feeds(fetch_tensors, target_ops, fed_tensors,
                        chained=chain_copies and budget is None)
    try:
        sizing = Sizing.of(graph, view, feed_shapes, concurrent_ops=kernels)
    except ValueError as exc:
        given = ", ".join(f"{name} [{','.join(map(str, dims))}]"
                          for name, dims in feed_shapes.items())
        raise UsageError(f"the feed shapes ({given}) do not fit the graph: "
                         f"{_shape_failure(str(exc))}") from None
    if budget is not None:
        from tfmem.memory import budget as budgets  # pylint: disable=import-outside-toplevel
        plan, trace = budgets.fit(view, sizing, budget, policy)
    else:
        plan = make_plan(view, partition_size or DEFAULT_PARTITION_SIZE, policy)
        trace = simulate(plan, sizing.shapes, scratch=sizing.scratch, **sizing.simulate_options())
    return plan, trace, sizing.shapes


def _write_outputs(args, plan, trace, shapes, budget):
    from tfmem.cli import plot, serialize  # pylint: disable=import-outside-toplevel
    from tfmem.run.measuring import trace as chrome  # pylint: disable=import-outside-toplevel
    written = []
    try:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump(serialize.plan_to_dict(plan, trace, shapes), out, indent=1)
                out.write("\n")
            written.append(f"plan: {args.json}")
        if args.plot:
            title = (f"{os.path.basename(args.model)}: {len(plan.partitions)} partitions "
                     f"(partition_size={plan.partition_size}, swap={plan.policy.mode}), "
                     "predicted memory")
            try:
                plot.plot_memory(trace, args.plot, title, budget=budget)
            except ImportError as exc:  # matplotlib went missing after the early check
                raise UsageError(f"--plot: {exc}") from None
            written.append(f"plot: {args.plot}")
        if args.trace:
            chrome.write_chrome_trace(planned_events(plan, trace, tensor_bytes(plan, shapes)),
                                      args.trace)
            written.append(f"trace: {args.trace} (nominal times, 1 ms per op)")
    except OSError as exc:
        raise UsageError(f"cannot write '{exc.filename}': {exc.strerror or exc}") from None
    return written


def _kernels_on_this_machine(inter_op_threads):
    """How many kernels the planned step may run at once: those of a session with
    `inter_op_threads` on the device a TFMemSession here would use, this machine's first
    GPU (found without starting TensorFlow's runtime), else its CPU."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.memory import concurrency  # pylint: disable=import-outside-toplevel
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    return concurrency.kernels_at_once(device, inter_op_threads)


def _run(args):
    from tfmem.cli import plot  # pylint: disable=import-outside-toplevel
    from tfmem.plan.swap import SwapPolicy  # pylint: disable=import-outside-toplevel
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--trace", args.trace)):
        if path:
            _check_output(path, flag)
    if args.plot and not plot.available():
        raise UsageError(f"--plot needs matplotlib, which is not installed: {plot.INSTALL_HINT}")
    budget = parse_size(args.budget, "--budget") if args.budget is not None else None
    policy = SwapPolicy(args.swap, args.swap_distance, args.prefetch,
                        parse_size(args.swap_min_bytes, "--swap-min-bytes", minimum=0))
    graph = load_graph(args.model)
    fetch_tensors, target_ops = resolve_fetches(graph, args.fetch)
    feed_shapes = resolve_feeds(graph, args.feed_shape)
    kernels = _kernels_on_this_machine(args.inter_op_threads)
    plan, trace, shapes = plan_request(graph, fetch_tensors, target_ops, feed_shapes, policy,
                                       args.partition_size, budget, kernels,
                                       chain_copies=not args.unchained)
    print(format_summary(plan, trace, model=args.model, budget=budget, kernels=kernels))
    written = _write_outputs(args, plan, trace, shapes, budget)
    if written:
        print("wrote " + "; ".join(written))
    return 0


def run(args):
    """Run ``tfmem plan`` with parsed `args`; returns the exit status."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfmem.errors import TFMemError  # pylint: disable=import-outside-toplevel
    try:
        return _run(args)
    except UsageError as exc:
        print(f"tfmem plan: error: {exc}", file=sys.stderr)
        return 2
    except TFMemError as exc:
        print(f"tfmem plan: cannot plan this request: {exc}", file=sys.stderr)
        return 1
