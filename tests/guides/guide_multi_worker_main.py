"""Guide: "Multi-worker training with Keras" (TensorFlow tutorial), its file main.py with the
fault-tolerance section's BackupAndRestore callback
https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras
Source: tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb (Apache-2.0).
Run on each worker with TF_CONFIG set (by hand, or by `kerasdist launch -n 2`); its model and data
come from mnist_setup.py beside it.

Every line changed from the tutorial for kerasdist (the user's diff):
  + import kerasdist                                   (added, first: it joins the cluster)
  - strategy = tf.distribute.MultiWorkerMirroredStrategy()   (removed)
  - with strategy.scope():                             (removed; the line under it dedented)
  (mnist_setup.py: + distribute="multiworker" in compile)
From the tutorial's fault-tolerance section: callbacks = [tf.keras.callbacks.BackupAndRestore(
  backup_dir='/tmp/backup')] and fit(..., callbacks=callbacks), as it shows them.
Changed for this test: backup_dir='/tmp/backup' -> os.environ.get("GUIDE_BACKUP_DIR", '/tmp/backup').
Shrunk for CI: nothing.
"""
import kerasdist

import os
import json

import tensorflow as tf
import mnist_setup

per_worker_batch_size = 64
tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

# Model building/compiling need to be within `strategy.scope()`.
multi_worker_model = mnist_setup.build_and_compile_cnn_model()

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=os.environ.get("GUIDE_BACKUP_DIR", '/tmp/backup'))]
multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70, callbacks=callbacks)
