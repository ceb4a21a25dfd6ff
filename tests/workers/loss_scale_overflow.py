"""mixed_float16 where only worker 1's gradients overflow: every worker must skip the same steps.

    loss_scale_overflow.py WORD OUTDIR [TAG]     (under `kerasdist launch -n 2` or `horovodrun -np 2`)

Worker 1's targets are 1e4, so its loss-scaled float16 gradients are inf at every step; worker 0's
are small and finite. Keras's LossScaleOptimizer skips a step whose gradients are not finite: all
workers must agree (they check the summed gradients), or one waits in an all-reduce the other
skipped. Each worker writes OUTDIR/rank<R>.npz: its weights and loss scale after 2 steps.
"""

import kerasdist  # noqa: I001  first: joins the cluster before any TensorFlow op

import os
import sys

import keras
import numpy as np


def main(word, outdir):
    cluster = kerasdist.detect_cluster()
    rank = 0 if cluster.is_local else cluster.task_index
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.set_weights([np.full(w.shape, 0.1, "float32") for w in model.weights])
    policy = os.environ.get("OVERFLOW_SHARD_POLICY", "off")  # strategy-free multiworker: "auto" (splits batches)
    options = {"horovod": {"shard": False}, "multiworker": {"shard_policy": policy}}[word]
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute=kerasdist.spec(word, **options))
    rng = np.random.default_rng(rank)
    x = (0.1 * rng.normal(size=(16, 4))).astype("float32")
    y = np.full((16, 2), 1e4 if rank == 1 else 0.0, "float32")
    import tensorflow as tf

    # a static batch size (drop_remainder): MultiWorkerMirroredStrategy's step refuses mixed_float16 on batches
    # that may split unevenly (plugins/multiworker)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True), epochs=1, verbose=0)
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), scale=float(model.optimizer.dynamic_scale.numpy()),
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
