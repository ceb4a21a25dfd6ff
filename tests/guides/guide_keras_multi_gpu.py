"""Guide: "Multi-GPU distributed training with TensorFlow" (keras.io, fchollet, last modified 2023/06/29)
https://keras.io/guides/distributed_training_with_tensorflow/
Source: keras-team/keras-io guides/distributed_training_with_tensorflow.py (Apache-2.0). Both code parts
of the guide are here (the prose is left out): single-host synchronous training, then fault tolerance
(ModelCheckpoint + make_or_restore_model + run_training twice).

Every line changed from the guide (the user's diff):
  + import kerasdist                                          (added after `import keras`)
  + distribute="mirrored",                                    (added to the compile call in get_compiled_model)
  - strategy = tf.distribute.MirroredStrategy()               (removed, twice: module level and run_training)
  - with strategy.scope():                                    (removed, twice; the block under it is dedented,
                                                               its lines are otherwise the guide's)
  ~ print("Number of devices: ...".format(strategy.num_replicas_in_sync))
    -> the same print with model.distribute_strategy.num_replicas_in_sync, moved after the model is built
       (the guide's `strategy` no longer exists)
Changed for this test: checkpoint_dir = "./ckpt" -> os.environ.get("GUIDE_CKPT_DIR", "./ckpt")
  (the test's temporary folder; unset, the guide's own value).
Shrunk for CI: nothing. Data: `keras.datasets.mnist.load_data()` is the guide's line; the test runs
this file with it returning tests/guides/_data.py's generated arrays (11000 train, 1000 test).
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf
import keras
import kerasdist


def get_compiled_model():
    # Make a simple 2-layer densely-connected neural network.
    inputs = keras.Input(shape=(784,))
    x = keras.layers.Dense(256, activation="relu")(inputs)
    x = keras.layers.Dense(256, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        distribute="mirrored",
    )
    return model


def get_dataset():
    batch_size = 32
    num_val_samples = 10000

    # Return the MNIST dataset in the form of a `tf.data.Dataset`.
    (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()

    # Preprocess the data (these are Numpy arrays)
    x_train = x_train.reshape(-1, 784).astype("float32") / 255
    x_test = x_test.reshape(-1, 784).astype("float32") / 255
    y_train = y_train.astype("float32")
    y_test = y_test.astype("float32")

    # Reserve num_val_samples samples for validation
    x_val = x_train[-num_val_samples:]
    y_val = y_train[-num_val_samples:]
    x_train = x_train[:-num_val_samples]
    y_train = y_train[:-num_val_samples]
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
    )


# Everything that creates variables should be under the strategy scope.
# In general this is only model construction & `compile()`.
model = get_compiled_model()
print("Number of devices: {}".format(model.distribute_strategy.num_replicas_in_sync))

# Train the model on all available devices.
train_dataset, val_dataset, test_dataset = get_dataset()
model.fit(train_dataset, epochs=2, validation_data=val_dataset)

# Test the model on all available devices.
model.evaluate(test_dataset)

# Prepare a directory to store all the checkpoints.
checkpoint_dir = os.environ.get("GUIDE_CKPT_DIR", "./ckpt")
if not os.path.exists(checkpoint_dir):
    os.makedirs(checkpoint_dir)


def make_or_restore_model():
    # Either restore the latest model, or create a fresh one
    # if there is no checkpoint available.
    checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        print("Restoring from", latest_checkpoint)
        return keras.models.load_model(latest_checkpoint)
    print("Creating a new model")
    return get_compiled_model()


def run_training(epochs=1):
    # Open a strategy scope and create/restore the model
    model = make_or_restore_model()

    callbacks = [
        # This callback saves a SavedModel every epoch
        # We include the current epoch in the folder name.
        keras.callbacks.ModelCheckpoint(
            filepath=checkpoint_dir + "/ckpt-{epoch}.keras",
            save_freq="epoch",
        )
    ]
    model.fit(
        train_dataset,
        epochs=epochs,
        callbacks=callbacks,
        validation_data=val_dataset,
        verbose=2,
    )


# Running the first time creates the model
run_training(epochs=1)

# Calling the same function again will resume from where we left off
run_training(epochs=1)
