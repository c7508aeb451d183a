"""`tfmem run`: the command line of tfmem.autowrap.

    tfmem run [--partition-size N | --budget SIZE] [tfmem options] script.py [args]
    tfmem run [options] -m package.module [args]
"""

import argparse

from tfmem import autowrap

DESCRIPTION = ("Run an unmodified TensorFlow graph-mode program with every "
               "tf.compat.v1.Session, InteractiveSession and monitored session it creates "
               "running its steps through tfmem; print per session, at exit, the steps, "
               "partitions, device peak (measured where TensorFlow keeps figures, and "
               "predicted for tfmem and for plain TensorFlow), bytes swapped and host RSS.")
EPILOG = ("Everything after the script (or -m module) is passed to it. The program's own "
          "output is unchanged; tfmem's summary goes to stderr. For launchers that start "
          "python themselves: TFMEM=partition_size=50 python -m tfmem.autowrap script.py.")


def add_arguments(parser):
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--partition-size", default=None,
                      help="the most ops a partition runs, or 'auto' (default 200)")
    size.add_argument("--budget", default=None,
                      help="device memory budget such as 2GiB: tfmem chooses the partitions")
    parser.add_argument("--swap", choices=("auto", "all", "none"), default=None)
    parser.add_argument("--swap-distance", type=int, default=None)
    parser.add_argument("--prefetch", type=int, default=None)
    parser.add_argument("--swap-min-bytes", default=None)
    parser.add_argument("--trace", default=None, help="write each step's Chrome trace here")
    parser.add_argument("--device-memory", type=int, default=None, metavar="MiB",
                        help="emulate an accelerator of this many MiB (TensorFlow's CPU "
                             "allocator capped; see tfmem.emulate_accelerator)")
    parser.add_argument("--summary-json", default=None, metavar="PATH",
                        help="also write the summary as JSON to PATH")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="the target is a module name, run as python -m does")
    parser.add_argument("target", metavar="script.py", help="the program to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")


def options_of(args):
    """TFMemSession's options and the runner's, from the parsed command line."""
    options = {}
    if args.partition_size is not None:
        options["partition_size"] = (args.partition_size if args.partition_size == "auto"
                                     else int(args.partition_size))
    if args.budget is not None:  # sizes are checked before the program starts
        options["device_memory_budget"] = args.budget
    for name in ("swap", "swap_distance", "prefetch", "trace", "device_memory", "summary_json"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.swap_min_bytes is not None:
        options["swap_min_bytes"] = args.swap_min_bytes
    return options


def run(args):
    try:
        options = options_of(args)
    except ValueError as error:
        print(f"tfmem run: {error}")
        return 2
    return autowrap.run_program(options, args.target, args.args, module=args.module)
