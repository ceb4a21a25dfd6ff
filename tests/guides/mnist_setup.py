"""Guide: "Multi-worker training with Keras" (TensorFlow tutorial), its file mnist_setup.py
https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras
Source: tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb (Apache-2.0).

Every line changed from the tutorial for kerasdist:
  + distribute="multiworker"          (added to the compile call)
Changed because stock Keras 3 needs it: InputLayer(input_shape=(28, 28)) -> InputLayer(shape=(28, 28))
  (Keras 3 renamed the argument).
Data: tf.keras.datasets.mnist.load_data() is the tutorial's line; the test runs it with generated arrays.
"""
import os

import tensorflow as tf
import numpy as np


def mnist_dataset(batch_size):
    (x_train, y_train), _ = tf.keras.datasets.mnist.load_data()
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=['accuracy'],
        distribute="multiworker")
    return model
