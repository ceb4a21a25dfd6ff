"""Guide: "Distributed training with Keras 3" (keras.io, Qianli Zhu, 2023/11/07)
https://keras.io/guides/distribution/
Source: keras-team/keras-io guides/distribution.py at commit 580fae8e (Apache-2.0), its code in order.
(keras.io has since rewritten the guide as "Distributed training with Keras" for JAX and PyTorch; its
DataParallel/ModelParallel/LayoutMap code is the same.)

Every line changed from the guide for kerasdist (the user's diff):
  + import kerasdist                                       (added after `import keras`)
  - keras.distribution.set_distribution(data_parallel)     (removed)
  + distribute=data_parallel                               (added to the first model.compile)
  - keras.distribution.set_distribution(model_parallel)    (removed)
  + distribute=model_parallel                              (added to the second model.compile)
  (the models are therefore built outside any distribution; kerasdist lays their variables out at compile)
Changed because Keras 3.15 needs it (stock Keras too): ModelParallel(layout_map, batch_dim_name="data")
  -> ModelParallel(layout_map=layout_map, batch_dim_name="data") (keyword-only now; the
  current keras.io guide writes it this way).
Changed because this machine has no GPU: devices = jax.devices("gpu") -> jax.devices() (8 host CPU
devices from XLA_FLAGS=--xla_force_host_platform_device_count=8, set by the test).
Shrunk for CI: nothing (the guide's data is already 128 random examples, 3 epochs).
The guide's closing mesh-shape examples (4 DeviceMesh objects, never used) are kept.
"""

import os

# The distribution API is only implemented for the JAX backend for now.
os.environ["KERAS_BACKEND"] = "jax"

import keras
import kerasdist
from keras import layers
import jax
import numpy as np
from tensorflow import data as tf_data  # For dataset input.

# Retrieve the local available gpu devices.
devices = jax.devices()  # Assume it has 8 local GPUs.

# Define a 2x4 device mesh with data and model parallel axes
mesh = keras.distribution.DeviceMesh(
    shape=(2, 4), axis_names=["data", "model"], devices=devices
)

# A 2D layout, which describes how a tensor is distributed across the
# mesh. The layout can be visualized as a 2D grid with "model" as rows and
# "data" as columns, and it is a [4, 2] grid when it mapped to the physical
# devices on the mesh.
layout_2d = keras.distribution.TensorLayout(axes=("model", "data"), device_mesh=mesh)

# A 4D layout which could be used for data parallel of a image input.
replicated_layout_4d = keras.distribution.TensorLayout(
    axes=("data", None, None, None), device_mesh=mesh
)

# Create DataParallel with list of devices.
# As a shortcut, the devices can be skipped,
# and Keras will detect all local available devices.
# E.g. data_parallel = DataParallel()
data_parallel = keras.distribution.DataParallel(devices=devices)

# Or you can choose to create DataParallel with a 1D `DeviceMesh`.
mesh_1d = keras.distribution.DeviceMesh(
    shape=(8,), axis_names=["data"], devices=devices
)
data_parallel = keras.distribution.DataParallel(device_mesh=mesh_1d)

inputs = np.random.normal(size=(128, 28, 28, 1))
labels = np.random.normal(size=(128, 10))
dataset = tf_data.Dataset.from_tensor_slices((inputs, labels)).batch(16)

# Note that all the model weights from here on are replicated to
# all the devices of the `DeviceMesh`. This includes the RNG
# state, optimizer states, metrics, etc. The dataset fed into `model.fit` or
# `model.evaluate` will be split evenly on the batch dimension, and sent to
# all the devices. You don't have to do any manual aggregration of losses,
# since all the computation happens in a global context.
inputs = layers.Input(shape=(28, 28, 1))
y = layers.Flatten()(inputs)
y = layers.Dense(units=200, use_bias=False, activation="relu")(y)
y = layers.Dropout(0.4)(y)
y = layers.Dense(units=10, activation="softmax")(y)
model = keras.Model(inputs=inputs, outputs=y)

model.compile(loss="mse", distribute=data_parallel)
model.fit(dataset, epochs=3)
model.evaluate(dataset)

mesh_2d = keras.distribution.DeviceMesh(
    shape=(2, 4), axis_names=["data", "model"], devices=devices
)
layout_map = keras.distribution.LayoutMap(mesh_2d)
# The rule below means that for any weights that match with d1/kernel, it
# will be sharded with model dimensions (4 devices), same for the d1/bias.
# All other weights will be fully replicated.
layout_map["d1/kernel"] = (None, "model")
layout_map["d1/bias"] = ("model",)

# You can also set the layout for the layer output like
layout_map["d2/output"] = ("data", None)

model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")

inputs = layers.Input(shape=(28, 28, 1))
y = layers.Flatten()(inputs)
y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
y = layers.Dropout(0.4)(y)
y = layers.Dense(units=10, activation="softmax", name="d2")(y)
model = keras.Model(inputs=inputs, outputs=y)

# The data will be sharded across the "data" dimension of the method, which
# has 2 devices.
model.compile(loss="mse", distribute=model_parallel)
model.fit(dataset, epochs=3)
model.evaluate(dataset)

full_data_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(8, 1), axis_names=["data", "model"], devices=devices
)
more_data_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(4, 2), axis_names=["data", "model"], devices=devices
)
more_model_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(2, 4), axis_names=["data", "model"], devices=devices
)
full_model_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(1, 8), axis_names=["data", "model"], devices=devices
)
