"""JAX backend: parameter + optimizer memory per device and step time of a >= 50M-parameter model on 8 host
CPU devices, under data parallelism, hybrid 2x4 and model parallelism 1x8, each through kerasdist (model built
first, then compile(distribute=...)) and hand-written keras.distribution code (distribution set before the model
is built), each run in its own process.

    python bench/bench_jax.py [--steps 5] [--rounds 2] [--width 4096]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MESHES = {"data_parallel": None, "hybrid 2x4": (2, 4), "model_parallel 1x8": (1, 8)}


def child(config, how, steps, width):
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import kerasdist
    import keras
    import numpy as np

    mesh_shape = MESHES[config]

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="relu", name=f"d{i}")
                                                             for i in range(3)] + [keras.layers.Dense(16, name="out")])

    optimizer = lambda: keras.optimizers.SGD(0.01, momentum=0.9)  # noqa: E731  one slot per weight
    devices = keras.distribution.list_devices()
    if how == "kerasdist":
        model = build()
        distribute = ("data_parallel" if mesh_shape is None else
                      kerasdist.hybrid(mesh={"batch": mesh_shape[0], "model": mesh_shape[1]}))
        model.compile(optimizer=optimizer(), loss="mse", distribute=distribute)
    else:
        if mesh_shape is None:
            distribution = keras.distribution.DataParallel(devices=devices)
        else:
            mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
            layout_map = keras.distribution.LayoutMap(mesh)
            layout_map[".*d[0-9]/kernel"] = (None, "model")
            layout_map[".*out/kernel"] = (None, "model")
            distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        keras.distribution.set_distribution(distribution)
        model = build()
        model.compile(optimizer=optimizer(), loss="mse")
    batch = 32
    x = np.random.default_rng(0).normal(size=(batch * (steps + 2), width)).astype("float32")
    y = np.random.default_rng(1).normal(size=(batch * (steps + 2), 16)).astype("float32")
    model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, epochs=1, verbose=0)  # compile + build slots
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(x[2 * batch:], y[2 * batch:], batch_size=batch, epochs=1, verbose=0, callbacks=[Timer()])
    import jax

    variables = list(model.variables) + list(model.optimizer.variables)
    first = jax.devices()[0]
    per_device = sum(shard.data.nbytes for v in variables for shard in v.value.addressable_shards
                     if shard.device == first)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print("RESULT", json.dumps({"config": config, "how": how, "params": params, "bytes_device0": per_device,
                                "step_s": statistics.median(times)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.steps, args.width)
    results = {}
    for _ in range(args.rounds):
        for config in MESHES:
            for how in ("hand-written", "kerasdist"):
                out = subprocess.run([sys.executable, __file__, "--child", config, how, "--steps", str(args.steps),
                                      "--width", str(args.width)], capture_output=True, text=True, check=True).stdout
                result = json.loads(out.split("RESULT", 1)[1])
                results.setdefault((config, how), []).append(result)
    data_parallel_bytes = results["data_parallel", "kerasdist"][0]["bytes_device0"]
    print(f"model: {results['data_parallel', 'kerasdist'][0]['params'] / 1e6:.1f} M parameters, SGD with momentum, "
          f"global batch 32, 8 host CPU devices on {os.cpu_count()} cores; medians of {args.rounds} runs x "
          f"{args.steps} steps")
    print("| configuration | bytes per device (params + optimizer) | vs data parallel | kerasdist step | "
          "hand-written step | hand-written / kerasdist |")
    print("|---|---|---|---|---|---|")
    for config in MESHES:
        mine, hand = results[config, "kerasdist"], results[config, "hand-written"]
        step = statistics.median(r["step_s"] for r in mine)
        hand_step = statistics.median(r["step_s"] for r in hand)
        size = mine[0]["bytes_device0"]
        assert size == hand[0]["bytes_device0"], (config, size, hand[0]["bytes_device0"])
        print(f"| {config} | {size / 2**20:.1f} MiB | {size / data_parallel_bytes:.3f}x | {step * 1e3:.0f} ms | "
              f"{hand_step * 1e3:.0f} ms | {hand_step / step:.3f} |")


if __name__ == "__main__":
    main()
