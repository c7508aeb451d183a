"""tfmem.keras: model.fit through tfmem against a plain fit with the same seeds.

Expected values always come from a plain Keras fit of an identically seeded
model; the memory proof runs plain and tfmem fits in fresh processes under
an emulated cap of half the plain step's peak.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.cli import proof_tf2


def build(seed=1, jit_compile=False):
    """A small MLP with dropout (random state in a SeedGenerator variable) and Adam."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(4),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  jit_compile=jit_compile)
    return model


def data(rows=200, seed=0):
    rs = np.random.RandomState(seed)
    return (rs.standard_normal((rows, 16)).astype(np.float32),
            rs.standard_normal((rows, 4)).astype(np.float32))


@pytest.mark.parametrize("options", [
    dict(partition_size=20, swap="all", options=tfmem.Options(swap_min_bytes=0)),
    dict(device_memory_budget="1GiB"),
])
@pytest.mark.slow
def test_fit_matches_plain_fit(options):
    x, y = data()
    plain = build()
    # 200 rows at batch 32: six full batches and a last one of 8 (a retrace, as in Keras).
    expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    model = tfmem.keras.partitioned(build(), **options)
    got = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    assert got == expected  # every loss and metric, bit for bit
    for e, g in zip(plain.weights, model.weights):  # kernels, biases, optimizer, seed state
        np.testing.assert_array_equal(g.numpy(), e.numpy(), err_msg=e.path)
    step = tfmem.keras.train_step_of(model)
    assert isinstance(step, tfmem.PartitionedFunction) and step.last_step is not None
    if "partition_size" in options:
        assert step.last_step.partitions > 1 and step.last_step.swapped_out > 0
    else:
        assert step.last_step.partitions == 1  # the step fits the budget whole
    report = step.memory_report()  # the last (partial) batch's plan
    assert len(report.predicted_partition_peaks) == step.last_step.partitions
    assert report.host_buffers == step.host_buffers.capacity_bytes
    # evaluate and predict stay Keras's own functions, with the same results
    assert tfmem.keras.train_step_of(plain) is None
    assert model.evaluate(x, y, verbose=0) == plain.evaluate(x, y, verbose=0)
    np.testing.assert_array_equal(model.predict(x, verbose=0), plain.predict(x, verbose=0))
    assert not hasattr(model.test_function, "tfmem_step")
    assert not hasattr(model.predict_function, "tfmem_step")


def test_steps_per_execution():
    x, y = data(rows=96)
    models = []
    for partition in (False, True):
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                      jit_compile=False, steps_per_execution=2)
        models.append(tfmem.keras.partitioned(model, partition_size=20) if partition else model)
    histories = [m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
                 for m in models]
    assert histories[1] == histories[0]
    assert models[1].optimizer.iterations.numpy() == models[0].optimizer.iterations.numpy() == 12


def test_partitioned_before_compile_and_recompile():
    x, y = data(rows=64)
    plain = build()
    expected = plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(4)])
    tfmem.keras.partitioned(model, partition_size=15)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  jit_compile=False)
    assert model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history == expected
    assert tfmem.keras.train_step_of(model).last_step.partitions > 1


def test_refusals():
    with pytest.raises(tfmem.UnsupportedGraphError, match="jit_compile"):
        model = tfmem.keras.partitioned(build(jit_compile=True))
        model.fit(*data(rows=32), batch_size=32, verbose=0)
    with pytest.raises(TypeError, match="jit_compile"):
        tfmem.keras.partitioned(build(), jit_compile=True)
    with pytest.raises(ValueError, match="partition_size"):
        tfmem.keras.partitioned(build(), partition_size=-1)
    eager = build()
    eager.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(ValueError, match="run_eagerly"):
        tfmem.keras.partitioned(eager).fit(*data(rows=32), batch_size=32, verbose=0)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        distributed = build()
    with pytest.raises(tfmem.UnsupportedGraphError, match="distribution strategies"):
        tfmem.keras.partitioned(distributed).fit(*data(rows=32), batch_size=32, verbose=0)


@pytest.mark.slow
def test_memory_proof_tf2():
    """Plain fit OOMs under half its peak; through tfmem it trains there, same losses."""
    result = proof_tf2.run_proof(steps=3, timeout=600)
    plain, capped, tfmem_run = result["plain"], result["plain_capped"], result["tfmem_capped"]
    assert not plain["failed"] and not plain["oom"] and len(plain["losses"]) == 3, plain
    assert capped is not None and not capped["failed"], capped
    assert capped["oom"], f"plain fit under {result['cap_mib']} MiB did not run out: {capped}"
    assert not tfmem_run["failed"] and not tfmem_run["oom"], tfmem_run
    assert 0 < tfmem_run["peak_bytes"] <= result["cap_mib"] << 20
    assert tfmem_run["losses"] == plain["losses"]  # bit-equal running-mean losses
    assert tfmem_run["partitions"] > 1
    assert result["ok"]
