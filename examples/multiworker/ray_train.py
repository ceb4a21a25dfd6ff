"""Multi-worker training driven by Ray Train: Ray starts the workers and sets TF_CONFIG.

    pip install "ray[train]"
    python examples/multiworker/ray_train.py

Ray's TensorflowTrainer sets TF_CONFIG in each worker before calling
``train_loop_per_worker``; kerasdist is imported there, first, so it joins the
cluster before any TensorFlow op (Ray itself must not have run TF ops in the worker).
Stock Keras 3 fails in this setup (ray-project/ray#47464); kerasdist makes it train.
"""

import os


def train_loop_per_worker(config):
    import kerasdist  # noqa: F401  first TensorFlow-related import in the worker

    import keras
    import numpy as np

    rng = np.random.RandomState(0)
    x = rng.rand(2048, 8).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 4).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"],
                  distribute="multiworker")
    model.fit(x, y, batch_size=config["batch_size"], epochs=config["epochs"],
              verbose=2 if kerasdist.is_chief() else 0)


def main():
    from ray.train import ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={"batch_size": 128, "epochs": 3},
        scaling_config=ScalingConfig(num_workers=int(os.environ.get("NUM_WORKERS", "2")), use_gpu=False),
    )
    print(trainer.fit())


if __name__ == "__main__":
    main()
