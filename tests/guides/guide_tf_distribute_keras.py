"""Guide: "Distributed training with Keras" (TensorFlow tutorial, MirroredStrategy on MNIST)
https://www.tensorflow.org/tutorials/distribute/keras
Source: tensorflow/docs site/en/tutorials/distribute/keras.ipynb (Apache-2.0), its code cells in order
(the notebook's shell cells `!ls` are left out).

Every line changed from the tutorial for kerasdist (the user's diff):
  + import kerasdist                                            (added after `import tensorflow as tf`)
  - strategy = tf.distribute.MirroredStrategy()                 (removed)
  ~ print('Number of devices: ...'.format(strategy.num_replicas_in_sync))
    -> NUM_REPLICAS = 2 (the replicas the user asks for; see BATCH_SIZE) and the print moved after compile
       with model.distribute_strategy.num_replicas_in_sync
  ~ BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync -> * NUM_REPLICAS
  - with strategy.scope():                                      (removed twice; blocks dedented)
  + distribute="mirrored"                                       (added to the first compile and to the
                                                                 compile of the model loaded "with the scope")
Changed because stock Keras 3 needs it (plain Keras 3 without kerasdist needs the same lines):
  ~ tfds.load('mnist') -> the guide's data from keras.datasets.mnist.load_data() in tf.data (no download;
    tensorflow_datasets is not a dependency); num_train_examples/num_test_examples from those arrays
  ~ input_shape=(28, 28, 1) on Conv2D -> a keras.Input((28, 28, 1)) first layer
  ~ checkpoint_prefix "ckpt_{epoch}" -> "ckpt_{epoch}.weights.h5"; model.load_weights(
    tf.train.latest_checkpoint(checkpoint_dir)) -> load_weights of the last epoch's file
  ~ model.optimizer.lr -> model.optimizer.learning_rate
  ~ path = 'saved_model/'; model.save(path, save_format='tf') -> path = 'my_model.keras'; model.save(path)
Changed for this test: checkpoint_dir, the logs and the saved model go under GUIDE_WORKDIR (default ".").
Shrunk for CI: EPOCHS 12 -> 2 (the LearningRateScheduler's decay is kept), train data 11000 -> 4096 examples.
"""

import os

import tensorflow as tf
import kerasdist
import keras

WORKDIR = os.environ.get("GUIDE_WORKDIR", ".")

(x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
x_train, y_train = x_train[:4096], y_train[:4096]
mnist_train = tf.data.Dataset.from_tensor_slices((x_train[..., None], y_train))
mnist_test = tf.data.Dataset.from_tensor_slices((x_test[..., None], y_test))

NUM_REPLICAS = 2

num_train_examples = len(x_train)
num_test_examples = len(x_test)

BUFFER_SIZE = 10000

BATCH_SIZE_PER_REPLICA = 64
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * NUM_REPLICAS


def scale(image, label):
    image = tf.cast(image, tf.float32)
    image /= 255

    return image, label


train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(32, 3, activation='relu'),
    tf.keras.layers.MaxPooling2D(),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(64, activation='relu'),
    tf.keras.layers.Dense(10)
])

model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=tf.keras.optimizers.Adam(),
              metrics=['accuracy'],
              distribute="mirrored")
print('Number of devices: {}'.format(model.distribute_strategy.num_replicas_in_sync))

# Define the checkpoint directory to store the checkpoints
checkpoint_dir = os.path.join(WORKDIR, 'training_checkpoints')
# Name of the checkpoint files
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.weights.h5")


# Function for decaying the learning rate.
# You can define any decay function you need.
def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


# Callback for printing the LR at the end of each epoch.
class PrintLR(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print('\nLearning rate for epoch {} is {}'.format(epoch + 1,
                                                          model.optimizer.learning_rate.numpy()))


callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir=os.path.join(WORKDIR, 'logs')),
    tf.keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix,
                                       save_weights_only=True),
    tf.keras.callbacks.LearningRateScheduler(decay),
    PrintLR()
]

EPOCHS = 2
model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)

model.load_weights(checkpoint_prefix.format(epoch=EPOCHS))

eval_loss, eval_acc = model.evaluate(eval_dataset)

print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))

path = os.path.join(WORKDIR, 'my_model.keras')

model.save(path)

unreplicated_model = tf.keras.models.load_model(path)

unreplicated_model.compile(
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizer=tf.keras.optimizers.Adam(),
    metrics=['accuracy'])

eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)

print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))

replicated_model = tf.keras.models.load_model(path)
replicated_model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         optimizer=tf.keras.optimizers.Adam(),
                         metrics=['accuracy'],
                         distribute="mirrored")

eval_loss, eval_acc = replicated_model.evaluate(eval_dataset)
print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))
