"""JAX-backend checks in their own process: ``jax_checks.py OUT_JSON``. Bad input, save/load, auto, layout."""

import json
import os
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import kerasdist  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402


def model(units=64):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(units, name="d1"), keras.layers.Dense(8, name="d2")])


def attempt(build):
    start = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
        return {"ok": True, "warnings": [str(w.message) for w in caught]}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}


x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
y = np.random.default_rng(1).normal(size=(64, 8)).astype("float32")
model()  # the first model starts JAX and compiles its kernels: here, not inside the first timed case
results = {}
results["mesh_size"] = attempt(lambda: model().compile(loss="mse", distribute=kerasdist.hybrid(mesh={"batch": 2, "model": 3})))
results["unknown_axis"] = attempt(lambda: kerasdist.hybrid(mesh={"batch": 2, "model": 4}, layout={"d1/kernel": (None, "tensor")}))
results["not_divisible"] = attempt(lambda: model(units=30).compile(
    loss="mse", distribute=kerasdist.hybrid(mesh={"batch": 2, "model": 4}, layout={"d1/kernel": (None, "model")})))
results["unused_rule"] = attempt(lambda: model().compile(
    loss="mse", distribute=kerasdist.hybrid(mesh={"batch": 2, "model": 4}, layout={"nothing/kernel": (None, "model")})))
for name in ("mirrored", "horovod", "ps"):
    results[f"tf_only_{name}"] = attempt(lambda name=name: model().compile(loss="mse", distribute=name))


def odd_batch():
    m = model()
    m.compile(loss="mse", optimizer="sgd", distribute=kerasdist.hybrid(mesh={"batch": 2, "model": 4}))
    m.fit(x, y, batch_size=7, epochs=1, verbose=0)


results["batch_not_divisible"] = attempt(odd_batch)


def unbuilt():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.layers.Dense(64, name="d1"), keras.layers.Dense(8, name="d2")])


results["unbuilt_hybrid"] = attempt(lambda: unbuilt().compile(loss="mse", distribute=kerasdist.hybrid(
    mesh={"batch": 2, "model": 4})))
# not built at compile, built by an explicit model.build: compile -> build -> fit -> evaluate -> save -> load_model
late = unbuilt()
late.compile(loss="mse", optimizer="sgd", distribute="data_parallel")
late.build((None, 16))
late.fit(x, y, batch_size=16, epochs=1, verbose=0)
late.evaluate(x, y, batch_size=16, verbose=0)
late.save(sys.argv[1] + ".late.keras")
late_again = keras.models.load_model(sys.argv[1] + ".late.keras")
results["unbuilt_late_build"] = {
    "spec": str(late.layers[0].kernel.value.sharding.spec),
    "devices": len(late.layers[0].kernel.value.sharding.device_set),
    "reload_diff": float(np.max(np.abs(np.asarray(late_again.predict(x, batch_size=16, verbose=0))
                                       - np.asarray(late.predict(x, batch_size=16, verbose=0)))))}

auto = model()
auto.compile(loss="mse", optimizer="sgd", distribute="auto")
results["auto"] = type(kerasdist.strategy_of(auto)).__name__

# save a sharded model, load into a plain one and into a sharded one: same predictions
sharded = model(units=64)
sharded.compile(loss="mse", optimizer="sgd", distribute=kerasdist.hybrid(mesh={"batch": 2, "model": 4}, min_shard_size=0))
sharded.fit(x, y, batch_size=16, epochs=1, verbose=0)
path = sys.argv[1] + ".keras"
sharded.save(path)
expected = np.asarray(sharded.predict(x, batch_size=16, verbose=0))
plain = kerasdist.load_plain(path)  # keras.models.load_model would compile it with hybrid again
again = keras.models.load_model(path)
again.compile(loss="mse", optimizer="sgd", distribute=kerasdist.hybrid(mesh={"batch": 2, "model": 4}, min_shard_size=0))
results["save_load"] = {
    "plain_diff": float(np.max(np.abs(np.asarray(plain.predict(x, batch_size=16, verbose=0)) - expected))),
    "sharded_diff": float(np.max(np.abs(np.asarray(again.predict(x, batch_size=16, verbose=0)) - expected))),
    "sharded_spec": str(sharded.layers[0].kernel.value.sharding.spec),
    "reloaded_spec": str(again.layers[0].kernel.value.sharding.spec),
}

# a model built under the user's own distribution keeps its layout
mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*d1/kernel"] = keras.distribution.TensorLayout(["model", None], mesh)
with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    own = model()
own.compile(loss="mse", optimizer="sgd", distribute=kerasdist.hybrid(mesh={"batch": 2, "model": 4}, min_shard_size=0))
own.fit(x, y, batch_size=16, epochs=1, verbose=0)
results["own_layout"] = str(own.layers[0].kernel.value.sharding.spec)

with open(sys.argv[1], "w") as f:
    json.dump(results, f)
print("DONE")
