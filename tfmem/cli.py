"""Command line interface: ``tfmem <command> [options]``.

Commands:
  demo   train a small MLP through a plain Session and TFMemSession side by
         side and compare losses and step times, optionally under an
         emulated accelerator's memory (``--device-memory MiB``); then run
         the memory proof, plain TensorFlow against tfmem under half the
         plain peak (see :mod:`tfmem.demo` and :mod:`tfmem.proof`).
"""

import argparse

from tfmem import demo


def _run_demo(args):
    return demo.run(args)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfmem",
        description="Partitioned execution of TensorFlow graph-mode requests.")
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    demo_parser = commands.add_parser(
        "demo", help="train a small MLP with and without tfmem and compare, then run "
                     "the memory proof",
        description="Train a small MLP through a plain Session and TFMemSession "
                    "side by side and compare losses and step times, then run the "
                    "memory proof: a step plain TensorFlow cannot fit in half its peak "
                    "memory trains under tfmem with the same losses.")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=_run_demo)
    return parser


def main(argv=None):
    """Entry point of the ``tfmem`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
