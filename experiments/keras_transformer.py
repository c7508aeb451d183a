"""Keras Transformer encoder: the longest sequence each system trains under one cap.

A Transformer encoder written with Keras layers (tfmem/cli/keras_models.py:
token and position embeddings, blocks of MultiHeadAttention and
feed-forward with residual sums and layer norms, a per-token classifier),
Adam; attention's activations grow with the square of the length, the size
knob.  Systems: keras_common.py.

    python experiments/keras_transformer.py --quick
    python experiments/keras_transformer.py --system tfmem --seq-len 512 --device-memory 200
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: import from the root

from experiments.harness.main import main
from experiments.harness.options import positive_int
from experiments import keras_common

STEP = 16  # the search moves in sequences of 16 tokens


def _length_index(length):
    if length < STEP or length % STEP:
        raise ValueError(f"--seq-len must be a positive multiple of {STEP}, got {length}")
    return length // STEP


def build(length, args, recompute_blocks):
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    return keras_models.transformer(length, d_model=args.d_model, heads=args.heads,
                                    layers=args.layers, ff=2 * args.d_model, vocab=args.vocab,
                                    seed=args.seed, recompute_blocks=recompute_blocks)


def data(length, args):
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    return keras_models.transformer_data(args.batch_size, length, args.vocab, args.seed)


def blocks(args):
    return [f"encoder{index}" for index in range(args.layers)]


def add_arguments(group):
    group.add_argument("--d-model", type=positive_int, help="(default 64)")
    group.add_argument("--heads", type=positive_int, help="(default 4)")
    group.add_argument("--layers", type=positive_int, help="encoder blocks (default 4)")
    group.add_argument("--vocab", type=positive_int, help="(default 256)")
    group.add_argument("--seed", type=int, help="(default 0)")


EXPERIMENT = keras_common.experiment(
    name="keras_transformer",
    title="Keras Transformer encoder, sequence length",
    size="seq_len", size_help=f"tokens per sequence (a multiple of {STEP})",
    sizes=lambda k: STEP * k, index_of=_length_index,
    build=build, data=data, script=__file__, add_arguments=add_arguments,
    model_args=("d_model", "heads", "layers", "vocab", "seed"),
    defaults=dict(d_model=64, heads=4, layers=4, vocab=256, seed=0, batch_size=4, steps=6,
                  trial_timeout=900.0),
    quick=dict(layers=4, cap_base=64, start=64, batch_size=4, steps=6, swap_min_bytes=65536,
               trial_timeout=180.0, tolerance=0.125, search_time=300.0, max_trials=6),
    unit="sequences", remat_layer_names=blocks)


if __name__ == "__main__":
    raise SystemExit(main(EXPERIMENT))
