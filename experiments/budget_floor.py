"""What budget mode's floor is made of: the one-op-per-partition plan of an experiment's model.

When budget mode finds that nothing fits (`BudgetError`: "even one op per
partition needs ..."), this prints the terms of that plan's peak partition
as `budget.predict` adds them: the state, the other tensors resident when it
starts, its uploads, its kernel scratch (calibrated in this process, under
the cap given), the chunk allowance, and the rest (chunk rounding, copies
held to the partition's end).  The kernel scratch is calibrated under the
allocator this process runs, so pass the experiment's cap.

    python experiments/budget_floor.py resnet --layers 96 --device-memory 110

The session runs the experiment's --session-config: under "tfmem" (Grappler
off) sums are planned without units.py's regrouping rule, as tfmem.Session's.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("model", choices=("resnet", "moe", "deepspeech"))
    parser.add_argument("--device-memory", type=int, required=True, metavar="MiB",
                        help="the emulated cap the kernel scratch is calibrated under")
    known, rest = parser.parse_known_args(argv)
    import common  # pylint: disable=import-outside-toplevel
    tf, experiment, args, model = common.script_model(known.model, rest, known.device_memory)
    from tfmem.plan.analyse import analyse  # pylint: disable=import-outside-toplevel
    from tfmem.plan.build import build_plan  # pylint: disable=import-outside-toplevel
    from tfmem.plan.partition import partition  # pylint: disable=import-outside-toplevel
    from tfmem.plan.swap import SwapPolicy  # pylint: disable=import-outside-toplevel
    from tfmem.memory import budget  # pylint: disable=import-outside-toplevel
    from tfmem.memory.sizing import Sizing  # pylint: disable=import-outside-toplevel
    from tfmem.memory.simulate import simulate, TensorSizes  # pylint: disable=import-outside-toplevel
    from tfmem.run.regrouping import runs_arithmetic_optimizer  # pylint: disable=import-outside-toplevel
    config = common.session_config(tf, "tfmem", args.inter_op_threads, args.intra_op_threads,
                                   args.session_config)
    sess = tf.compat.v1.Session(graph=model.graph, config=config)
    sess.run(model.init)
    with model.graph.as_default():
        view = analyse([model.loss], [model.train_op], list(model.feed),
                       runs_arithmetic_optimizer(config))
    sizing = Sizing.of(model.graph, view, {t.name: v.shape for t, v in model.feed.items()}, sess)
    policy = SwapPolicy(min_bytes=args.swap_min_bytes if args.swap_min_bytes is not None
                        else 1 << 20, swap_distance=0)
    plan = build_plan(view, partition(view, budget.units(view), 1), 1, policy, None)
    slack = budget.chunk_slack(view, TensorSizes(view, sizing.shapes))
    trace = simulate(plan, sizing.shapes, early_frees=False, scratch=sizing.scratch, slack=slack,
                     chunks=True, **sizing.simulate_options())
    index, peak = max(enumerate(trace.partitions), key=lambda item: item[1].device_peak)
    rest = (peak.device_peak - peak.device_before - peak.to_device - peak.scratch - slack)
    print(f"{known.model} {experiment.size} {args.size}, cap {known.device_memory} MiB, "
          f"session config {args.session_config}: one op per "
          f"partition ({len(plan.partitions)} partitions) peaks at {peak.device_peak / MIB:.1f} "
          f"MiB in partition {index}, {', '.join(plan.partitions[index].ops)}")
    for name, value in (("state (variables, constants)", trace.state_bytes),
                        ("other tensors resident when it starts",
                         peak.device_before - trace.state_bytes),
                        ("its uploads", peak.to_device), ("its kernel scratch", peak.scratch),
                        ("chunk allowance (largest tensor)", slack),
                        ("the rest (chunk rounding, copies held to its end)", rest)):
        print(f"  {name:<50} {value / MIB:7.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
