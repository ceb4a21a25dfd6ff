"""Guide: TensorFlow's "Load and preprocess images" tutorial, its "Using tf.data for finer control" part
https://www.tensorflow.org/tutorials/load_data/images
Source: tensorflow/docs site/en/tutorials/load_data/images.ipynb (Apache-2.0): the file list shuffled once,
split, decoded with tf.io, then `configure_for_performance` (cache, `shuffle(buffer_size=1000)`, reshuffled every
epoch, batch, prefetch) and the tutorial's small convnet trained on it. Run under each word by
tests/guides/test_guide_words.py.

Every line changed from the tutorial (the user's diff):
  + import kerasdist (first); WORD = os.environ.get("GUIDE_DISTRIBUTE") or None     (the word the test runs it under)
  + distribute=WORD,                                  (added to the compile call)
  + tf.keras.utils.set_random_seed(1337)              (after the imports: the same initial weights and the same
                                                       epoch orders in one process and distributed)
Changed for the comparison: optimizer='adam' -> 'sgd' (Adam divides a gradient difference away).
Replaced (no internet here): data_dir = tf.keras.utils.get_file(origin=dataset_url, fname='flower_photos',
  untar=True) -> os.environ["GUIDE_FLOWERS_DIR"]: the test writes 160 random 40x40 JPEGs there, 32 in each of the
  5 flower folders (tests/guides/test_guide_words.py).
Shrunk for CI: img_height = img_width = 180 -> 32.
Left out: the first part (image_dataset_from_directory, its plots and the Rescaling/AUTOTUNE demonstration), the
  plots, and the TensorFlow Datasets part at the end.
"""

import kerasdist  # noqa: F401,I001  first: a multi-worker job joins before any TensorFlow op

import os
import pathlib

import numpy as np
import tensorflow as tf

WORD = os.environ.get("GUIDE_DISTRIBUTE") or None
tf.keras.utils.set_random_seed(1337)

data_dir = pathlib.Path(os.environ["GUIDE_FLOWERS_DIR"])
image_count = len(list(data_dir.glob('*/*.jpg')))

batch_size = 32
img_height = 32
img_width = 32

AUTOTUNE = tf.data.AUTOTUNE

list_ds = tf.data.Dataset.list_files(str(data_dir/'*/*'), shuffle=False)
list_ds = list_ds.shuffle(image_count, reshuffle_each_iteration=False)

for f in list_ds.take(5):
  print(f.numpy())

class_names = np.array(sorted([item.name for item in data_dir.glob('*') if item.name != "LICENSE.txt"]))
print(class_names)

val_size = int(image_count * 0.2)
train_ds = list_ds.skip(val_size)
val_ds = list_ds.take(val_size)

print(tf.data.experimental.cardinality(train_ds).numpy())
print(tf.data.experimental.cardinality(val_ds).numpy())


def get_label(file_path):
  # Convert the path to a list of path components
  parts = tf.strings.split(file_path, os.path.sep)
  # The second to last is the class-directory
  one_hot = parts[-2] == class_names
  # Integer encode the label
  return tf.argmax(one_hot)


def decode_img(img):
  # Convert the compressed string to a 3D uint8 tensor
  img = tf.io.decode_jpeg(img, channels=3)
  # Resize the image to the desired size
  return tf.image.resize(img, [img_height, img_width])


def process_path(file_path):
  label = get_label(file_path)
  # Load the raw data from the file as a string
  img = tf.io.read_file(file_path)
  img = decode_img(img)
  return img, label


# Set `num_parallel_calls` so multiple images are loaded/processed in parallel.
train_ds = train_ds.map(process_path, num_parallel_calls=AUTOTUNE)
val_ds = val_ds.map(process_path, num_parallel_calls=AUTOTUNE)

for image, label in train_ds.take(1):
  print("Image shape: ", image.numpy().shape)
  print("Label: ", label.numpy())


def configure_for_performance(ds):
  ds = ds.cache()
  ds = ds.shuffle(buffer_size=1000)
  ds = ds.batch(batch_size)
  ds = ds.prefetch(buffer_size=AUTOTUNE)
  return ds


train_ds = configure_for_performance(train_ds)
val_ds = configure_for_performance(val_ds)

num_classes = 5

model = tf.keras.Sequential([
  tf.keras.layers.Rescaling(1./255),
  tf.keras.layers.Conv2D(32, 3, activation='relu'),
  tf.keras.layers.MaxPooling2D(),
  tf.keras.layers.Conv2D(32, 3, activation='relu'),
  tf.keras.layers.MaxPooling2D(),
  tf.keras.layers.Conv2D(32, 3, activation='relu'),
  tf.keras.layers.MaxPooling2D(),
  tf.keras.layers.Flatten(),
  tf.keras.layers.Dense(128, activation='relu'),
  tf.keras.layers.Dense(num_classes)
])

model.compile(
  optimizer='sgd',
  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  metrics=['accuracy'],
  distribute=WORD)

model.fit(
  train_ds,
  validation_data=val_ds,
  epochs=3
)
