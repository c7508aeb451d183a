"""Keras ResNet-50: the largest batch each system trains under one cap.

`keras.applications.ResNet50(weights=None)` on image x image RGB inputs,
Adam, as a user takes it from Keras; the size knob is the batch.  Systems:
keras_common.py (ResNet50 is not written in blocks, so there is no
recomputed-blocks system; RematScope(mode="list_of_layers") gets its
convolutions).

    python experiments/keras_resnet50.py --quick --allocator one-region
    python experiments/keras_resnet50.py --quick --state-share 0.33 --allocator one-region
    python experiments/keras_resnet50.py --find-max --cap-base 16 --image 64 --state-share 0.1
    python experiments/keras_resnet50.py --system tfmem --batch 16 --device-memory 600
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: import from the root

from experiments.harness.main import main
from experiments.harness.options import positive_int
from experiments import keras_common


def _batch_index(batch):
    if batch < 1:
        raise ValueError(f"--batch must be at least 1, got {batch}")
    return batch


def build(batch, args, recompute_blocks):  # pylint: disable=unused-argument
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    return keras_models.resnet50(args.image, args.classes, args.seed)


def data(batch, args):
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    return keras_models.resnet50_data(batch, args.image, args.classes, args.seed)


def convolutions(args):
    """ResNet50's convolution layer names (keras.applications names them conv*_conv)."""
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    model = keras_models.resnet50(args.image, args.classes, args.seed)
    return [layer.name for layer in model.layers if layer.name.endswith("_conv")]


def add_arguments(group):
    group.add_argument("--image", type=positive_int, help="image side (default 64)")
    group.add_argument("--classes", type=positive_int, help="(default 10)")
    group.add_argument("--seed", type=int, help="(default 0)")


EXPERIMENT = keras_common.experiment(
    name="keras_resnet50",
    title="Keras ResNet-50 (keras.applications), batch size",
    size="batch", size_help="images per step", sizes=lambda k: k, index_of=_batch_index,
    build=build, data=data, script=__file__, add_arguments=add_arguments,
    model_args=("image", "classes", "seed"),
    defaults=dict(image=64, classes=10, seed=0, steps=6, trial_timeout=900.0),
    # The cap is the state (weights, gradients, Adam's slots: 360 MiB whatever the image)
    # over the share, so plain fit's largest batch is hundreds of images even at 32x32
    # (about 1.9 MiB and 45 ms a step per image here).  Quick: the smallest image, plain fit
    # and tfmem only, searches from batch 512, three steps and three trials a system.
    quick=dict(image=32, cap_base=8, state_share=0.1, system=["plain", "tfmem"], start=512,
               steps=3, swap_min_bytes=65536, trial_timeout=480.0, tolerance=0.25,
               search_time=600.0, max_trials=3),
    unit="images", blocks=False, remat_layer_names=convolutions)


if __name__ == "__main__":
    raise SystemExit(main(EXPERIMENT))
