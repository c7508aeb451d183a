"""gpu_check: on a machine with a CUDA GPU, check what a CPU-only machine cannot.

    python tools/gpu_check.py                # about a minute on a GPU
    python tools/gpu_check.py --json out.json

Four checks, one report:

1. Memory proof with the GPU's own memory: the proof MLP (tfmem.cli.proof) trains
   plainly without a cap (peak P on GPU:0), then in fresh processes with the
   GPU capped at P/2 by `tf.config.set_logical_device_configuration`: plain
   TensorFlow must raise ResourceExhaustedError, TFMemSession must train with
   the plain losses and a peak under the cap.
2. Page-locked host buffers: a buffer of the session's HostBufferPool is
   registered with CUDA (`cudaHostGetFlags` succeeds on it).
3. Placement: the placement pass put every variable on the host, and
   TensorFlow's own placement (the run's partition graphs) shows the
   variables on CPU:0 and the MatMuls on the GPU.
4. Prefetch overlap: in the step's timeline (TFMemSession(trace=...)),
   uploads of swapped tensors ran while partitions ran.

Exits 0 when every check passes, 1 when one fails, 2 on a machine without a
GPU (nothing is run).  `--cpu-stand-in` runs the same code with a second CPU
device standing in for the GPU and the emulated allocator cap, to develop
the tool without a GPU: there checks 2 (no CUDA) fails by construction.
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tfmem.cli import child_env  # noqa: E402  (imports no TensorFlow)

MIB = 1 << 20
NO_GPU_EXIT = 2
MODEL = dict(layers=24, batch=1024, width=256, steps=5, seed=0)
UNCAPPED_STAND_IN_MIB = 16384  # the emulated "GPU" of --cpu-stand-in when no cap is asked


def no_gpu_message():
    """Why the check cannot run here, or None when TensorFlow sees a GPU."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if tf.config.list_physical_devices("GPU"):
        return None
    built = "built with CUDA" if tf.test.is_built_with_cuda() else "built WITHOUT CUDA"
    return (f"gpu_check: no CUDA GPU visible to TensorFlow {tf.__version__} ({built}); "
            "tf.config.list_physical_devices('GPU') is empty. This check needs a machine with "
            "a CUDA GPU and a CUDA build of TensorFlow. Nothing was run.")


# ------------------------------------------------------------------ one process


def build(tf, device, layers, batch, width, seed):
    """The proof MLP (tfmem.cli.proof.build_model) with its ops on `device`."""
    from tfmem.cli import proof  # pylint: disable=import-outside-toplevel
    return proof.build_model(tf, layers, batch, width, seed, device=device)


def page_locked(pool):
    """True when a buffer the pool hands out is registered with the CUDA runtime."""
    from tfmem.run.executing import buffers  # pylint: disable=import-outside-toplevel
    cudart = buffers.loaded_cudart()
    if cudart is None:
        return False
    array = pool.acquire((1 << 16,), "float32")
    try:
        flags = ctypes.c_uint(0)
        return cudart.cudaHostGetFlags(ctypes.byref(flags),
                                       ctypes.c_void_p(array.ctypes.data)) == 0
    finally:
        pool.release(array)


def overlap(trace_path):
    """(ms of uploads that ran while a partition ran, ms of uploads) in a Chrome trace."""
    with open(trace_path, encoding="utf-8") as source:
        events = json.load(source)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = {}
    for e in events:
        if e["ph"] == "X":
            spans.setdefault(names.get(e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    uploads, partitions = spans.get("prefetch", []), spans.get("partitions", [])
    shared = sum(max(0.0, min(end, p_end) - max(start, p_start))
                 for start, end in uploads for p_start, p_end in partitions)
    return shared / 1e3, sum(end - start for start, end in uploads) / 1e3


def devices_of(run, fetches, feeds, tf):
    """{op type: sorted devices} TensorFlow ran `fetches` on, from the partition graphs."""
    metadata = tf.compat.v1.RunMetadata()
    run(fetches, feeds, options=tf.compat.v1.RunOptions(output_partition_graphs=True),
        run_metadata=metadata)
    found = {}
    for partition in metadata.partition_graphs:
        for node in partition.node:
            found.setdefault(node.op, set()).add(node.device.rsplit("/", 1)[-1])
    return {op: sorted(devices) for op, devices in found.items()}


def worker(system, cap_mib, stand_in, partition_size, trace_path, model):
    """Train in this process; returns a dict of what the orchestrator checks."""
    import tfmem  # pylint: disable=import-outside-toplevel
    if stand_in:
        tfmem.emulate_accelerator(cap_mib or UNCAPPED_STAND_IN_MIB)  # before TensorFlow
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel

    if not stand_in and cap_mib:
        gpu = tf.config.list_physical_devices("GPU")[0]
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=cap_mib)])
        # Create the GPU's allocator now, with the cap: TensorFlow keeps one per GPU and
        # process, and the session below (config=None) takes the same configuration.
        tf.config.list_logical_devices("GPU")
    device, memory_device = ("CPU:1", "CPU:0") if stand_in else ("GPU:0", "GPU:0")
    graph, x, loss, train_op, init = build(tf, "/device:" + device, model["layers"],
                                           model["batch"], model["width"], MODEL["seed"])
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2}) if stand_in else None
    sess = tf.compat.v1.Session(graph=graph, config=config)
    runner = sess if system == "tf" else tfmem.TFMemSession(
        sess, partition_size=partition_size, trace=trace_path,
        options=tfmem.Options(accelerator_device=device if stand_in else None))
    rng = np.random.default_rng(MODEL["seed"])
    batches = [rng.standard_normal((model["batch"], model["width"])).astype(np.float32)
               for _ in range(model["steps"])]
    result = dict(system=system, cap_mib=cap_mib, losses=[], oom=None, peak_bytes=0,
                  step_times=[])
    runner.run(init)
    accelerator.reset_peak(memory_device)
    for batch in batches:
        started = time.perf_counter()
        try:
            result["losses"].append(float(runner.run([train_op, loss], {x: batch})[1]))
        except tf.errors.ResourceExhaustedError as error:
            result["oom"] = error.message.strip().splitlines()[0][:200]
            break
        finally:
            memory = accelerator.device_memory(memory_device)
            result["peak_bytes"] = max(result["peak_bytes"], memory["peak"] if memory else 0)
        result["step_times"].append(time.perf_counter() - started)
    if system == "tfmem" and result["oom"] is None:
        plan = runner.plan([train_op, loss], {x: batches[0]})
        placement = plan.placement
        result.update(
            placement=str(placement).splitlines()[0],
            moved=sorted(placement.moved), stays=dict(placement.stays),
            variables=sorted(op.name for op in graph.get_operations()
                             if op.type == "VarHandleOp"),
            devices=devices_of(runner.run, [train_op, loss], {x: batches[0]}, tf),
            swapped_out_bytes=runner.last_step.swapped_out_bytes,
            pinned_pool=runner.host_buffers.pinned,
            page_locked=page_locked(runner.host_buffers),
            accelerator=device)
        runner.run([train_op, loss], {x: batches[0]})  # the traced step for the overlap
        result["overlap_ms"], result["uploads_ms"] = overlap(trace_path)
    sess.close()
    return result


# ------------------------------------------------------------------ orchestration


def run_worker(system, cap_mib, args, trace_path=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system,
           "--partition-size", str(args.partition_size)]
    for key in ("layers", "batch", "width", "steps"):
        cmd += [f"--{key}", str(getattr(args, key))]
    cmd += ["--cap", str(cap_mib)] if cap_mib else []
    cmd += ["--cpu-stand-in"] if args.cpu_stand_in else []
    cmd += ["--trace", trace_path] if trace_path else []
    env = child_env.self_capping_env(child_env.onednn_from_env(default=False))
    result, _, tail = child_env.run_json_child(cmd, env, args.timeout)
    if result is None:
        return dict(system=system, cap_mib=cap_mib, failed=True, error=tail)
    return dict(result, failed=False)


def checks(plain, plain_capped, tfmem_run):
    """[(name, passed, detail)] of the four checks."""
    from tfmem.cli.proof import losses_match  # pylint: disable=import-outside-toplevel
    cap = plain_capped["cap_mib"]
    result = []
    fits = not tfmem_run["failed"] and tfmem_run["oom"] is None and \
        tfmem_run["peak_bytes"] <= cap * MIB
    same = not tfmem_run["failed"] and losses_match(plain["losses"], tfmem_run["losses"])
    plain_oom = not plain_capped["failed"] and plain_capped["oom"] is not None
    if tfmem_run["failed"]:
        tfmem_text = "failed: " + tfmem_run["error"]
    elif tfmem_run["oom"] is not None:
        tfmem_text = "ResourceExhaustedError: " + tfmem_run["oom"]
    else:
        tfmem_text = (f"peak {tfmem_run['peak_bytes'] / MIB:.0f} MiB, losses "
                      f"{'equal' if same else 'DIFFER'}")
    result.append(("memory proof", plain_oom and fits and same,
                   f"plain peak {plain['peak_bytes'] / MIB:.0f} MiB; cap {cap} MiB: plain "
                   f"{'ResourceExhaustedError' if plain_oom else 'did not fail'}, tfmem "
                   + tfmem_text))
    if tfmem_run["failed"] or tfmem_run["oom"] is not None:
        return result + [(name, False, "tfmem did not train")
                         for name in ("page-locked buffers", "placement", "prefetch overlap")]
    result.append(("page-locked buffers", tfmem_run["page_locked"],
                   f"pool pins: {tfmem_run['pinned_pool']}, cudaHostGetFlags on a pool buffer: "
                   f"{'registered' if tfmem_run['page_locked'] else 'not registered'}"))
    devices = tfmem_run["devices"]
    state_devices = set(devices.get("VarHandleOp", [])) | set(
        devices.get("ResourceApplyGradientDescent", []))
    compute = set(devices.get("MatMul", []))
    placed = (set(tfmem_run["moved"]) == set(tfmem_run["variables"]) and
              state_devices == {"device:CPU:0"} and
              compute == {"device:" + tfmem_run["accelerator"]})
    summary = tfmem_run["placement"].removeprefix("placement: ")
    result.append(("placement", placed, f"{summary}; variables and updates ran on "
                   f"{sorted(state_devices)}, MatMul on {sorted(compute)}"))
    overlapped, uploads = tfmem_run["overlap_ms"], tfmem_run["uploads_ms"]
    result.append(("prefetch overlap", overlapped > 0,
                   f"{overlapped:.1f} of {uploads:.1f} ms of uploads ran while a partition ran "
                   f"({tfmem_run['swapped_out_bytes'] / MIB:.0f} MiB swapped out per step)"))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--partition-size", type=int, default=20)
    for key in ("layers", "batch", "width", "steps"):
        parser.add_argument(f"--{key}", type=int, default=MODEL[key],
                            help=f"of the proof MLP (default {MODEL[key]})")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--json", metavar="PATH", help="also write every figure here")
    parser.add_argument("--cpu-stand-in", action="store_true",
                        help="develop without a GPU: CPU:1 stands in, the cap is emulated")
    parser.add_argument("--worker", choices=("tf", "tfmem"), help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model = {key: getattr(args, key) for key in ("layers", "batch", "width", "steps")}
        print(json.dumps(worker(args.worker, args.cap, args.cpu_stand_in, args.partition_size,
                                args.trace, model)))
        return 0
    if not args.cpu_stand_in:
        message = no_gpu_message()
        if message:
            print(message, file=sys.stderr)
            return NO_GPU_EXIT
    say = lambda text: print(text, flush=True)  # noqa: E731
    say("plain Session, no cap ...")
    plain = run_worker("tf", None, args)
    if plain["failed"] or plain["oom"] or not plain["peak_bytes"]:
        say(f"gpu_check: the uncapped plain run failed: {plain.get('error') or plain.get('oom')}")
        return 1
    cap = plain["peak_bytes"] // 2 // MIB
    say(f"plain Session, cap {cap} MiB ...")
    plain_capped = run_worker("tf", cap, args)
    say(f"TFMemSession, cap {cap} MiB ...")
    trace_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gpu_check_{os.getpid()}.json")
    tfmem_run = run_worker("tfmem", cap, args, trace_path)
    results = checks(plain, plain_capped, tfmem_run)
    say("")
    for name, passed, detail in results:
        say(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    if not tfmem_run["failed"] and plain["step_times"] and tfmem_run["step_times"]:
        say(f"median step: plain (no cap) {statistics.median(plain['step_times']) * 1e3:.0f} ms,"
            f" tfmem (cap) {statistics.median(tfmem_run['step_times']) * 1e3:.0f} ms")
    ok = all(passed for _, passed, _ in results)
    say("gpu_check: " + ("PASSED" if ok else "FAILED"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(dict(plain=plain, plain_capped=plain_capped, tfmem=tfmem_run,
                           checks=results, ok=ok), out, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
