"""The keras.io guide's ModelParallel example ("Distributed training with Keras 3") in kerasdist's one-word
form, in its own process: ``jax_guide_layout.py OUT_JSON``. Records the data layout Keras uses during fit,
the sharding of d2's output inside the traced train step, the warnings, and the weights against one device."""

import json
import os
import sys
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import kerasdist  # noqa: E402

MESH = {"data": 2, "model": 4}
GUIDE_LAYOUT = {"d1/kernel": (None, "model"), "d1/bias": ("model",), "d2/output": ("data", None)}


class ShardingProbe(keras.layers.Layer):
    """Passes its input through and records its sharding (d2's output) inside the traced step."""

    def __init__(self, seen, **kwargs):
        super().__init__(**kwargs)
        self.record = seen.append  # a bound method: Keras would track (copy) a list attribute

    def call(self, x):
        jax.debug.inspect_array_sharding(x, callback=self.record)
        return x


def guide_model(units, seen):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    y = keras.layers.Flatten()(inputs)
    y = keras.layers.Dense(200, activation="relu", name="d1")(y)
    y = keras.layers.Dense(units, activation="softmax", name="d2")(y)
    return keras.Model(inputs, ShardingProbe(seen, name="probe")(y))


data_layouts = []
_get_data_layout = keras.distribution.ModelParallel.get_data_layout


def recording_get_data_layout(self, data_shape):
    layout = _get_data_layout(self, data_shape)
    data_layouts.append(list(layout.axes))
    return layout


keras.distribution.ModelParallel.get_data_layout = recording_get_data_layout


def guide_model_parallel(layout):
    """The guide's own object: keras.distribution.ModelParallel over a LayoutMap of ``layout``."""
    mesh = keras.distribution.DeviceMesh(shape=tuple(MESH.values()), axis_names=list(MESH), devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, axes in layout.items():
        layout_map[pattern] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def train(units, layout):
    """Fit 2 epochs; returns the weights, the warnings, d2's output shardings and the mesh. ``layout``: a
    hybrid layout dict, or a keras.distribution object passed as is (built before the model), or None."""
    seen = []
    distribute = kerasdist.hybrid(mesh=MESH, layout=layout) if isinstance(layout, dict) else layout
    model = guide_model(units, seen)
    x = np.random.default_rng(0).normal(size=(64, 28, 28, 1)).astype("float32")
    y = keras.utils.to_categorical(np.random.default_rng(1).integers(0, units, 64), units)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer="sgd", loss="categorical_crossentropy", distribute=distribute)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, [str(w.message) for w in caught], seen


def sharding_is(sharding, *spec):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4),
                             tuple(MESH))
    return sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*spec)), len(spec))


def trained_as(plain, units, layout):
    """What ``train(units, layout)`` did: data layouts, warnings, d2's output, d1's specs, |dw| vs one device."""
    data_layouts.clear()
    model, caught, seen = train(units, layout)
    return {
        "data_layouts": data_layouts[:],
        "warnings": caught,
        "d2_output": [str(s) for s in seen],
        "d2_output_is_data_none": bool(seen) and all(sharding_is(s, "data", None) for s in seen),
        "kernel_spec": str(model.get_layer("d1").kernel.value.sharding.spec),
        "bias_spec": str(model.get_layer("d1").bias.value.sharding.spec),
        "max_weight_diff": max(float(np.max(np.abs(a - b)))
                               for a, b in zip(model.get_weights(), plain.get_weights())),
    }


results = {}
plain, _, _ = train(10, None)
results["guide"] = trained_as(plain, 10, GUIDE_LAYOUT)
results["guide_model_parallel_object"] = trained_as(plain, 10, guide_model_parallel(GUIDE_LAYOUT))
results["guide_data_parallel_object"] = trained_as(plain, 10, keras.distribution.DataParallel(devices=jax.devices()))
try:
    guide_model(10, []).compile(loss="mse", distribute=guide_model_parallel({"d1/kernel": ("model",)}))
    results["model_parallel_rule_rank"] = None
except kerasdist.KerasdistError as exc:
    results["model_parallel_rule_rank"] = str(exc)
_, caught, seen = train(8, {**GUIDE_LAYOUT, "d2/output": (None, "model")})
results["output_rule_on_model_axis"] = {
    "warnings": caught,
    "d2_output": [str(s) for s in seen],
    "d2_output_is_none_model": bool(seen) and all(sharding_is(s, None, "model") for s in seen),
}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    unmatched = kerasdist.hybrid(mesh=MESH, layout={"d9/output": ("data", None)})
    guide_model(10, []).compile(loss="mse", distribute=unmatched)
results["unused_output_rule"] = [str(w.message) for w in caught]
try:
    guide_model(10, []).compile(loss="mse", distribute=kerasdist.hybrid(mesh=MESH, layout={"d2/output": ("data",)}))
    results["output_rule_rank"] = None
except kerasdist.KerasdistError as exc:
    results["output_rule_rank"] = str(exc)
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=2)
