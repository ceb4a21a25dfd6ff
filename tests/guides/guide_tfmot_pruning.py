"""Guide: "Pruning in Keras example" (TensorFlow Model Optimization)
https://www.tensorflow.org/model_optimization/guide/pruning/pruning_with_keras
Source: tensorflow/model-optimization tensorflow_model_optimization/g3doc/guide/pruning/pruning_with_keras.ipynb
(Apache-2.0), its code cells up to "Create 3x smaller models from pruning" and the pruned TFLite file.

TFMOT rejects Keras 3 models (and importing it switches tf.keras to Keras 2), so its API is replaced by
kerasdist's; every line changed (the user's diff):
  ~ the guide's `keras` (Keras 2 through TFMOT / tf.keras) -> import keras (Keras 3); + import kerasdist
  ~ import tensorflow_model_optimization as tfmot -> from kerasdist_plugins import pruning
  - prune_low_magnitude = tfmot.sparsity.keras.prune_low_magnitude                 (removed)
  ~ pruning_params = {'pruning_schedule': tfmot.sparsity.keras.PolynomialDecay(initial_sparsity=0.50,
        final_sparsity=0.80, begin_step=0, end_step=end_step)}
    -> prune = kerasdist.prune(schedule="polynomial", initial_sparsity=0.50, target_sparsity=0.80,
        begin_step=0, end_step=end_step, frequency=10)   (TFMOT's PolynomialDecay's default frequency is 100,
        more steps than this run has: kerasdist would warn and prune only at the end)
  ~ model_for_pruning = prune_low_magnitude(model, **pruning_params) -> model_for_pruning = model
  + distribute=["mirrored", prune]                        (added to the recompile: pruning on 2 replicas)
  ~ callbacks = [UpdatePruningStep(), PruningSummaries(log_dir=logdir)] -> [keras.callbacks.TensorBoard(
        log_dir=logdir)] (kerasdist adds its own pruning-step callback; the sparsity is logged as "sparsity")
  ~ model_for_export = tfmot.sparsity.keras.strip_pruning(model_for_pruning) -> pruning.strip(model_for_pruning)
Changed because stock Keras 3 needs it: InputLayer(input_shape=(28, 28)) -> InputLayer(shape=(28, 28)).
Shrunk for CI: the baseline's epochs=4 -> 1. Data: tf.keras.datasets.mnist.load_data() is the guide's
line; the test runs it with generated arrays (11000 train, 1000 test).
"""

import tempfile
import os

import tensorflow as tf
import numpy as np

import keras
import kerasdist

# Load MNIST dataset
(train_images, train_labels), (test_images, test_labels) = tf.keras.datasets.mnist.load_data()

# Normalize the input image so that each pixel value is between 0 and 1.
train_images = train_images / 255.0
test_images = test_images / 255.0

# Define the model architecture.
model = keras.Sequential([
    keras.layers.InputLayer(shape=(28, 28)),
    keras.layers.Reshape(target_shape=(28, 28, 1)),
    keras.layers.Conv2D(filters=12, kernel_size=(3, 3), activation='relu'),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Flatten(),
    keras.layers.Dense(10)
])

# Train the digit classification model
model.compile(optimizer='adam',
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=['accuracy'])

model.fit(
    train_images,
    train_labels,
    epochs=1,
    validation_split=0.1,
)

_, baseline_model_accuracy = model.evaluate(
    test_images, test_labels, verbose=0)

print('Baseline test accuracy:', baseline_model_accuracy)

_, keras_file = tempfile.mkstemp('.h5')
keras.models.save_model(model, keras_file, include_optimizer=False)
print('Saved baseline model to:', keras_file)

from kerasdist_plugins import pruning

# Compute end step to finish pruning after 2 epochs.
batch_size = 128
epochs = 2
validation_split = 0.1  # 10% of training set will be used for validation set.

num_images = train_images.shape[0] * (1 - validation_split)
end_step = np.ceil(num_images / batch_size).astype(np.int32) * epochs

# Define model for pruning.
prune = kerasdist.prune(schedule="polynomial", initial_sparsity=0.50, target_sparsity=0.80,
                        begin_step=0, end_step=end_step, frequency=10)

model_for_pruning = model

# `prune_low_magnitude` requires a recompile.
model_for_pruning.compile(optimizer='adam',
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=['accuracy'],
                          distribute=["mirrored", prune])

model_for_pruning.summary()

logdir = tempfile.mkdtemp()

callbacks = [
    keras.callbacks.TensorBoard(log_dir=logdir),
]

model_for_pruning.fit(train_images, train_labels,
                      batch_size=batch_size, epochs=epochs, validation_split=validation_split,
                      callbacks=callbacks)

_, model_for_pruning_accuracy = model_for_pruning.evaluate(
    test_images, test_labels, verbose=0)

print('Baseline test accuracy:', baseline_model_accuracy)
print('Pruned test accuracy:', model_for_pruning_accuracy)

model_for_export = pruning.strip(model_for_pruning)

_, pruned_keras_file = tempfile.mkstemp('.h5')
keras.models.save_model(model_for_export, pruned_keras_file, include_optimizer=False)
print('Saved pruned Keras model to:', pruned_keras_file)

converter = tf.lite.TFLiteConverter.from_keras_model(model_for_export)
pruned_tflite_model = converter.convert()

_, pruned_tflite_file = tempfile.mkstemp('.tflite')

with open(pruned_tflite_file, 'wb') as f:
    f.write(pruned_tflite_model)

print('Saved pruned TFLite model to:', pruned_tflite_file)
