"""Guide: Horovod's Keras MNIST example, examples/tensorflow2/tensorflow2_keras_mnist.py
https://github.com/horovod/horovod/blob/master/examples/tensorflow2/tensorflow2_keras_mnist.py
Copyright 2019 Uber Technologies, Inc. Licensed under the Apache License, Version 2.0.
Run as Horovod says: `horovodrun -np 2 -H localhost:2 python <this file>`.

`horovod.tensorflow.keras` does not work with Keras 3 (horovod#4290); kerasdist's "horovod" strategy
takes its place. Every line changed (the user's diff):
  ~ import horovod.tensorflow.keras as hvd -> import horovod.tensorflow as hvd (init/rank/size/local_rank,
    the same functions); + import kerasdist
  - opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)
  + distribute=kerasdist.horovod(batch_size_per_worker=True, backward_passes_per_step=1,
        average_aggregated_gradients=True, warmup_epochs=3)   (added to compile: the optimizer's options,
        Horovod's per-process batch of 128, and the warm-up below)
  - experimental_run_tf_function=False                     (removed from compile: Keras 3's compile refuses
                                                             it, and stock Keras 3 needs the same)
  - hvd.callbacks.BroadcastGlobalVariablesCallback(0),     (removed: kerasdist broadcasts rank 0's state
  - hvd.callbacks.MetricAverageCallback(),                  at the start of fit and averages the epoch logs)
  - hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
                                                           (removed: the warmup_epochs=3 option above)
Shrunk for CI: epochs=24 -> 2, steps_per_epoch=500 // hvd.size() -> 60 // hvd.size().
Data: tf.keras.datasets.mnist.load_data(path=...) is the example's line; the test runs it with generated
arrays. The checkpoint-{epoch}.h5 files go to the working directory, as in the example (the test's).
"""

import sys

import tensorflow as tf

import horovod
import horovod.tensorflow as hvd
import kerasdist


def train():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    (mnist_images, mnist_labels), _ = \
        tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
                 tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'],
                        distribute=kerasdist.horovod(batch_size_per_worker=True, backward_passes_per_step=1,
                                                     average_aggregated_gradients=True, warmup_epochs=3))

    callbacks = []

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.h5'))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(dataset, steps_per_epoch=60 // hvd.size(), callbacks=callbacks, epochs=2, verbose=verbose)

    # Return the model
    return mnist_model


if __name__ == '__main__':
    if len(sys.argv) == 4:
        # run training through horovod.run
        np = int(sys.argv[1])
        hosts = sys.argv[2]
        comm = sys.argv[3]
        print('Running training through horovod.run')
        models = horovod.run(train, np=np, hosts=hosts, use_gloo=comm == 'gloo', use_mpi=comm == 'mpi', verbose=2)
    else:
        # this is running via horovodrun
        train()
