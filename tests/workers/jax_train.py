"""JAX-backend training in its own process: ``jax_train.py MODE OUT_NPZ [key=value ...]``.

Modes: plain (one device, no distribution), data_parallel, hybrid (mesh from MESH=2x4, layout default).
Writes the final weights, per-variable shard fractions and the layout table to OUT_NPZ / OUT_NPZ.json.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import kerasdist  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
options = dict(arg.split("=", 1) for arg in sys.argv[3:])
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = (x @ rng.normal(size=(16, 8))).astype("float32")

model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="tanh", name="d1"),
                          keras.layers.Dense(32, activation="tanh", name="d2"), keras.layers.Dense(8, name="d3")])
distribute = None
if mode == "data_parallel":
    distribute = "data_parallel"
elif mode == "hybrid":
    batch, model_axis = map(int, options.get("mesh", "2x4").split("x"))
    distribute = kerasdist.hybrid(mesh={"batch": batch, "model": model_axis}, min_shard_size=0, show_layout=True)
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", distribute=distribute)
if options.get("crash") and not kerasdist.is_chief():
    print("CRASHING", flush=True)
    os._exit(3)
history = model.fit(x, y, batch_size=int(options.get("batch", 32)), epochs=2, shuffle=False, verbose=0)

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

fractions = {}
for v in model.weights:
    value = v.value
    shards = value.addressable_shards
    fractions[v.path] = [s.data.size / value.size for s in shards]
weights = [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) if jax.process_count() > 1
           else np.asarray(v.value) for v in model.weights]  # every process takes part in the gather
if not kerasdist.is_chief():
    sys.exit(0)
np.savez(out, *weights)
with open(out + ".json", "w") as f:
    json.dump({"fractions": fractions, "loss": history.history["loss"],
               "devices": len(jax.devices()), "processes": jax.process_count(),
               "specs": {v.path: str(getattr(v.value.sharding, "spec", None)) for v in model.weights}}, f)
print("DONE", mode, history.history["loss"])
