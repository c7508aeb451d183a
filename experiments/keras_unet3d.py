"""Keras 3D U-Net: the largest cubic input each system trains under one cap.

A 3D U-Net written with Keras layers (tfmem/cli/keras_models.py: Conv3D +
ReLU pairs as blocks, 3D max pooling, transposed convolutions, skip
concatenations, a per-voxel softmax), Adam; the size knob is the side of the
cubic one-channel input, a multiple of 2 ** (levels - 1).  Systems:
keras_common.py.

    python experiments/keras_unet3d.py --quick
    python experiments/keras_unet3d.py --system tfmem --side 32 --device-memory 400
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: import from the root

from experiments.harness.main import main
from experiments.harness.options import positive_int
from experiments import keras_common

STEP = 4  # the side is a multiple of 2 ** (levels - 1); levels is 3


def _side_index(side):
    if side < STEP or side % STEP:
        raise ValueError(f"--side must be a positive multiple of {STEP}, got {side}")
    return side // STEP


def build(side, args, recompute_blocks):
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    return keras_models.unet3d(side, filters=args.filters, levels=3, classes=2, seed=args.seed,
                               recompute_blocks=recompute_blocks)


def data(side, args):
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    return keras_models.unet3d_data(args.batch_size, side, classes=2, seed=args.seed)


def blocks(args):  # pylint: disable=unused-argument
    return ["down0", "down1", "bottom", "up1", "up0"]


def add_arguments(group):
    group.add_argument("--filters", type=positive_int,
                       help="filters at the top level, doubling per level (default 8)")
    group.add_argument("--seed", type=int, help="(default 0)")


EXPERIMENT = keras_common.experiment(
    name="keras_unet3d",
    title="Keras 3D U-Net, input side",
    size="side", size_help=f"side of the cubic input (a multiple of {STEP})",
    sizes=lambda k: STEP * k, index_of=_side_index,
    build=build, data=data, script=__file__, add_arguments=add_arguments,
    model_args=("filters", "seed"),
    defaults=dict(filters=8, seed=0, batch_size=1, steps=6, trial_timeout=900.0),
    quick=dict(filters=8, cap_base=8, start=8, batch_size=1, steps=6, swap_min_bytes=65536,
               trial_timeout=180.0, tolerance=0.125, search_time=300.0, max_trials=6),
    unit="volumes", remat_layer_names=blocks)


if __name__ == "__main__":
    raise SystemExit(main(EXPERIMENT))
