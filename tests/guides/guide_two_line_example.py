"""Guide: kerasdist's own seed example, "the two-line change" with ResNet50
(README.md and docs/quickstart.md of this repository: `import kerasdist` and `distribute="mirrored"`).
ResNet50 itself took 67-137 s here for 2 steps on 2 CPU replicas (36 s of CPU; 2 shared cores), over the
corpus's 60 s budget, so the model is MobileNetV3Small: the two changed lines are the same.

The quickstart's code, with its `train_dataset` / `eval_dataset` placeholders filled in:
  ~ train_dataset, eval_dataset: 16 generated MNIST-shaped images (tests/guides/_data.py) tiled to 3
    channels and resized to 32x32, batches of 8
Shrunk for CI: keras.applications.ResNet50 -> keras.applications.MobileNetV3Small (same arguments);
  input_shape (64, 64, 3) -> (32, 32, 3); epochs=10 -> 1; 2 train steps, 1 eval step.
"""

import numpy as np
import tensorflow as tf

import keras
import kerasdist                                   # 1: adds distribute= to Model.compile

(images, labels), _ = keras.datasets.mnist.load_data()
images = np.repeat(images[:16, :, :, None], 3, axis=-1).astype("float32") / 255
images = tf.image.resize(images, (32, 32)).numpy()
train_dataset = tf.data.Dataset.from_tensor_slices((images, labels[:16].astype("int32"))).batch(8)
eval_dataset = train_dataset.take(1)

model = keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=10)
model.compile(optimizer=keras.optimizers.SGD(0.1),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"],
              distribute="mirrored")               # 2: train on every local GPU (or logical CPU)
model.fit(train_dataset, epochs=1)
model.evaluate(eval_dataset)
