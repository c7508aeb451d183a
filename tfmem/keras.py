"""tfmem.keras: run Keras `model.fit`'s train step through tfmem (Keras 3, TensorFlow backend).

    model.compile(optimizer="adam", loss="mse")
    tfmem.keras.partitioned(model, partition_size=200)   # or device_memory_budget="2GiB"
    model.fit(x, y, batch_size=256, epochs=3)            # train steps run in partitions
    print(tfmem.keras.train_step_of(model).last_step)    # StepStats of the last step
    model.evaluate(x, y); model.predict(x)               # unchanged: Keras's own functions

Keras builds its train function in `make_train_function`, which `fit` calls
(and `compile` resets).  `partitioned` replaces that method on this one model
instance: the new train function calls `model.train_step` through
`tfmem.function` (traced by a real `tf.function` with Keras's settings,
`reduce_retracing=True`), so losses, metrics, optimizer and callbacks are
Keras's own.  `make_test_function` and `make_predict_function` are not
touched.  The helper may be called before or after `compile`.

Refused: distribution strategies (out of scope), `run_eagerly=True` (there
is no graph to partition), and `jit_compile=True` given explicitly to
`compile`.  With `jit_compile="auto"` (Keras's default, which means XLA on
a GPU), the partitioned train step runs without XLA; evaluate and predict
keep it.
"""

import logging

import tensorflow as tf

from tfmem.tf2 import function as tfmem_function
from tfmem import tf_private
from tfmem.run.front_end import options as run_options
from tfmem.errors import UnsupportedGraphError

log = logging.getLogger(__name__)

_STEP_ATTRIBUTE = "tfmem_step"  # on the train function: the PartitionedFunction it calls


def _compiled_jit_setting(model):
    """What the user passed to compile(jit_compile=...): True, False or 'auto'."""
    config = getattr(model, "_compile_config", None)
    return getattr(config, "config", {}).get("jit_compile", "auto") if config else "auto"


def _check_model(model):
    if not getattr(model, "compiled", False):
        raise ValueError("tfmem.keras: compile the model (model.compile(...)) before fit")
    if tf.distribute.has_strategy() or getattr(model, "_distribute_strategy", None) is not None:
        raise UnsupportedGraphError(
            "tfmem.keras does not support distribution strategies: the model was built under "
            f"{type(model.distribute_strategy).__name__}. Train it without a strategy scope "
            "to use tfmem, or without tfmem under the strategy.")
    if model.run_eagerly:
        raise ValueError("tfmem.keras partitions the traced train step, but the model was "
                         "compiled with run_eagerly=True; compile it with run_eagerly=False")
    if _compiled_jit_setting(model) is True:
        tfmem_function._refuse_jit(True)  # pylint: disable=protected-access
    if model.jit_compile:
        log.info("tfmem.keras: the partitioned train step runs without XLA "
                 "(jit_compile='auto' chose XLA); evaluate and predict keep it")


def _train_function(model, options):
    """A train function for `fit`: `steps_per_execution` partitioned steps on the iterator."""

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        return model.train_step(data)

    step = tfmem_function.function(one_step_on_data, reduce_retracing=True, **options)
    call = tf_private.keras_autoconvert_optionals(model, step)

    def train_function(iterator):
        outputs = None
        for _, data in zip(range(model.steps_per_execution), iterator):
            outputs = call(data)
        if outputs is None:
            raise StopIteration
        return outputs

    setattr(train_function, _STEP_ATTRIBUTE, step)
    return train_function


def partitioned(model, partition_size=200, options=None, **settings):
    """Make `model.fit` run its train steps through `tfmem.function`; return the model.

    `partition_size`, `options` (a tfmem.Options) and `settings` (device_memory_budget,
    swap, swap_distance, prefetch, trace) mean what they mean for `tfmem.function`.
    Evaluate and predict stay Keras's own.
    """
    if "jit_compile" in settings:
        raise TypeError("tfmem.keras.partitioned takes no jit_compile: the partitioned step "
                        "never uses XLA")
    deprecated = {k: settings.pop(k) for k in tfmem_function.OLD_KEYWORDS if k in settings}
    options = dict(settings, partition_size=partition_size, options=run_options.resolve(
        options, deprecated, run_options.FUNCTION, caller="tfmem.keras.partitioned"))
    tfmem_function.function(lambda: None, **options)  # check the settings now

    def make_train_function(force=False):
        if model.train_function is not None and not force and \
                hasattr(model.train_function, _STEP_ATTRIBUTE):
            return model.train_function
        _check_model(model)
        model.train_function = _train_function(model, options)
        return model.train_function

    model.make_train_function = make_train_function
    model.train_function = None  # a train function Keras made earlier is replaced at fit
    return model


def train_step_of(model):
    """The `tfmem.function` running the model's train steps (its `last_step`, `plan`), or None."""
    return getattr(getattr(model, "train_function", None), _STEP_ATTRIBUTE, None)
