"""Serialize: a plan (and its predicted memory) as plain, deterministic JSON data.

`plan_to_dict` turns the frozen `Plan` into dicts, lists, strings, numbers
and booleans only, so that `json.dumps` takes it as it is and the same plan
always gives the same text:

    {"format": "tfmem.plan/1", "partition_size": 8,
     "policy": {"mode": "auto", "swap_distance": 2, "prefetch": 1, "min_bytes": 1048576},
     "request": {"fetches": ["loss:0"], "targets": ["train"], "feeds": ["x:0"]},
     "partitions": [{"index": 0, "ops": [...], "inputs": [], "outputs": ["relu:0"], ...}],
     "transfers": [{"tensor": "relu:0", "producer": 0, "consumers": [3],
                    "spans": [{"start": 2, "readers": [3], "uploaded": true}], ...}],
     "placement": {"accelerator": null, "moved": {}, "stays": {}, "copied": {}, ...},
     "memory": {...}}                       # only with a simulate.MemoryTrace

Lists keep the plan's order (partitions in run order, ops in plan order,
transfers by producer then name); sets (the feeds) and mappings (placement)
are sorted.  Byte counts of transfers come from the resolved shapes when
given (`shapes.resolve_shapes`), else from static shapes; null when unknown.
"""

import dataclasses

from tfmem.plan.analyse import tensor_bytes

FORMAT = "tfmem.plan/1"


def _shape(shape):
    return None if shape is None else [None if d is None else int(d) for d in shape]


def _transfer(plan, transfer, shapes):
    info = plan.view.tensor(transfer.tensor)
    shape = shapes.get(transfer.tensor, info.shape) if shapes else info.shape
    return {
        "tensor": transfer.tensor,
        "producer": transfer.producer,
        "consumers": list(transfer.consumers),
        "spans": [{"start": span.start, "readers": list(span.readers),
                   "uploaded": bool(span.uploaded)} for span in transfer.spans],
        "kept": bool(transfer.kept),
        "swapped": bool(transfer.swapped),
        "dtype": info.dtype.name,
        "shape": _shape(shape),
        "bytes": tensor_bytes(info.dtype, shape),
    }


def _partition(partition):
    return {
        "index": partition.index,
        "ops": list(partition.ops),
        "units": partition.units,
        "inputs": list(partition.inputs),
        "outputs": list(partition.outputs),
        "feeds": list(partition.feeds),
        "sources": list(partition.sources),
        "fetches": list(partition.fetches),
        "uploads": list(partition.uploads),
    }


def memory_to_dict(trace):
    """A simulate.MemoryTrace as plain data: totals, then one entry per partition."""
    return {
        "state_bytes": trace.state_bytes,
        "unknown_tensors": trace.unknown_tensors,
        "peak_device_bytes": trace.peak_device,
        "peak_device_chunks_bytes": trace.peak_device_chunks,
        "peak_partition": trace.peak_partition,
        "peak_host_bytes": trace.peak_host,
        "bytes_to_host": trace.bytes_to_host,
        "bytes_to_device": trace.bytes_to_device,
        "partitions": [dataclasses.asdict(p) for p in trace.partitions],
    }


def plan_to_dict(plan, trace=None, shapes=None):
    """The plan as JSON-ready data; with `trace` (a MemoryTrace of it), its memory too.

    `shapes` ({tensor name: shape}, from `shapes.resolve_shapes`) sizes the
    transfers; without it their static shapes are used.
    """
    placement = plan.placement
    result = {
        "format": FORMAT,
        "partition_size": plan.partition_size,
        "policy": dataclasses.asdict(plan.policy),
        "request": {
            "fetches": list(plan.view.fetches),
            "targets": list(plan.view.targets),
            "feeds": sorted(plan.view.feeds),
        },
        "num_ops": plan.num_ops,
        "partitions": [_partition(p) for p in plan.partitions],
        "transfers": [_transfer(plan, t, shapes) for t in plan.transfers],
        "placement": {
            "accelerator": placement.accelerator,
            "moved": dict(sorted(placement.moved.items())),
            "stays": dict(sorted(placement.stays.items())),
            "copied": dict(sorted(placement.copied.items())),
            "moved_bytes": placement.moved_bytes,
            "summary": str(placement),
        },
    }
    if trace is not None:
        result["memory"] = memory_to_dict(trace)
    return result
