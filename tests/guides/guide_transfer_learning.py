"""Guide: "Transfer learning & fine-tuning" (keras.io, fchollet, last modified 2023/06/25), its end-to-end example
https://keras.io/guides/transfer_learning/
Source: keras-team/keras-io guides/transfer_learning.py (Apache-2.0): the end-to-end example (freeze the base,
compile, fit the top; unfreeze with `base_model.trainable = True`, compile again, fit end to end; evaluate);
the prose, the plots and the sections before it are left out. Run under each word by tests/guides/test_guide_words.py.

Every line changed from the guide (the user's diff):
  + import kerasdist (first); WORD = os.environ.get("GUIDE_DISTRIBUTE") or None     (the word the test runs it under)
  + distribute=WORD,                                  (added to both compile calls)
  + keras.utils.set_random_seed(1337)                 (after the imports: one process and the distributed run
                                                       draw the same initial weights, dropout and augmentation)
Changed for the comparison: optimizer=keras.optimizers.Adam() -> SGD(learning_rate=0.1) and, for the fine-tuning,
  Adam(1e-5) -> SGD(learning_rate=0.02) (still the lower rate: Adam divides a gradient difference away, and at
  1e-5 the base would move less than the 1e-5 the test compares to).
Replaced (no internet here, and Xception is too slow on 2 CPU cores): tfds.load("cats_vs_dogs", ...) -> random
  uint8 images of 40x40 (256 train, 64 validation, 64 test, labels 0/1), made by the lines marked "# not the guide";
  keras.applications.Xception(weights="imagenet", input_shape=(150, 150, 3), include_top=False) -> a tiny conv base
  (Conv2D, BatchNormalization, Conv2D) named "base" on (32, 32, 3); Resizing(150, 150) -> Resizing(32, 32).
Left out: tfds.disable_progress_bar(), the cardinality prints and the two matplotlib figures.
"""

import kerasdist  # noqa: F401,I001  first: a multi-worker job joins before any TensorFlow op

import os

import numpy as np
import keras
from keras import layers
from tensorflow import data as tf_data

WORD = os.environ.get("GUIDE_DISTRIBUTE") or None
keras.utils.set_random_seed(1337)


def _random_images(count, seed):  # not the guide: cats_vs_dogs' (image, label) pairs, unbatched
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count, 40, 40, 3)).astype("uint8")
    return tf_data.Dataset.from_tensor_slices((images, rng.integers(0, 2, size=count)))


train_ds, validation_ds, test_ds = _random_images(256, 0), _random_images(64, 1), _random_images(64, 2)

resize_fn = keras.layers.Resizing(32, 32)

train_ds = train_ds.map(lambda x, y: (resize_fn(x), y))
validation_ds = validation_ds.map(lambda x, y: (resize_fn(x), y))
test_ds = test_ds.map(lambda x, y: (resize_fn(x), y))

augmentation_layers = [
    layers.RandomFlip("horizontal"),
    layers.RandomRotation(0.1),
]


def data_augmentation(x):
    for layer in augmentation_layers:
        x = layer(x)
    return x


train_ds = train_ds.map(lambda x, y: (data_augmentation(x), y))

batch_size = 64

train_ds = train_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()
validation_ds = validation_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()
test_ds = test_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()

base_model = keras.Sequential(  # not the guide: Xception's place, "pre-trained" by the seed
    [keras.Input((32, 32, 3)), layers.Conv2D(8, 3, strides=2, activation="relu"), layers.BatchNormalization(),
     layers.Conv2D(16, 3, activation="relu")], name="base")

# Freeze the base_model
base_model.trainable = False

# Create new model on top
inputs = keras.Input(shape=(32, 32, 3))

# Pre-trained Xception weights requires that input be scaled
# from (0, 255) to a range of (-1., +1.), the rescaling layer
# outputs: `(inputs * scale) + offset`
scale_layer = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)
x = scale_layer(inputs)

# The base model contains batchnorm layers. We want to keep them in inference mode
# when we unfreeze the base model for fine-tuning, so we make sure that the
# base_model is running in inference mode here.
x = base_model(x, training=False)
x = keras.layers.GlobalAveragePooling2D()(x)
x = keras.layers.Dropout(0.2)(x)  # Regularize with dropout
outputs = keras.layers.Dense(1)(x)
model = keras.Model(inputs, outputs)

model.summary(show_trainable=True)

model.compile(
    optimizer=keras.optimizers.SGD(learning_rate=0.1),
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.BinaryAccuracy()],
    distribute=WORD,
)

epochs = 2
print("Fitting the top layer of the model")
model.fit(train_ds, epochs=epochs, validation_data=validation_ds)

# Unfreeze the base_model. Note that it keeps running in inference mode
# since we passed `training=False` when calling it. This means that
# the batchnorm layers will not update their batch statistics.
# This prevents the batchnorm layers from undoing all the training
# we've done so far.
base_model.trainable = True
model.summary(show_trainable=True)

model.compile(
    optimizer=keras.optimizers.SGD(learning_rate=0.02),  # Low learning rate
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.BinaryAccuracy()],
    distribute=WORD,
)

epochs = 1
print("Fitting the end-to-end model")
model.fit(train_ds, epochs=epochs, validation_data=validation_ds)

print("Test dataset evaluation")
model.evaluate(test_ds)
