"""keras.io "Customizing what happens in fit() with PyTorch": its five custom-step models, each trained by
``torch_train.py --guide NAME`` (SGD instead of the guide's Adam; its data made small):

``first`` (compute_loss, ``loss.backward()``, ``optimizer.apply``, every metric updated by hand, logs
``{m.name: m.result()}``), ``lower`` (no compiled loss: its own loss function, ``Mean``/``MeanAbsoluteError``
trackers made in ``__init__``, a ``metrics`` property), ``sample_weight`` (the step unpacks a sample weight),
``test_step`` (Keras's train step, its own test step for ``evaluate``), ``gan`` (two optimizers set in its
own ``compile``, random latent vectors drawn in the step; ``gan_data_noise``: those draws given as data, the
same in one process and in the ranks); ``first_bn`` is ``first`` with a
BatchNormalization (``--sync-bn``: statistics over every rank). None of the steps calls ``scale_loss``.
``tracked_on_one_rank`` (``loss`` a metric's result on rank 0 only) and ``per_row_log`` (a per-row log: refused)
check the all-reduce of a step's logs; ``optimizer_in_dict`` (an optimizer kerasdist cannot see: refused).
Writes OUT/rank{r}.npz: the weights, each history key, each batch's logs (sorted keys), ``evaluate``.
"""

import os

import numpy as np
import torch

import keras


class CustomModel(keras.Model):
    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class LowerLevel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.loss_fn(y, y_pred)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class WithSampleWeight(keras.Model):
    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class OwnTestStep(keras.Model):
    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.built = True

    normal, uniform = staticmethod(keras.random.normal), staticmethod(keras.random.uniform)  # the guide's draws

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn, distribute=None):
        super().compile(distribute=distribute)  # the word, added to the guide's super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(real_images, tuple) or isinstance(real_images, list):
            real_images = real_images[0]
        batch_size = real_images.shape[0]
        random_latent_vectors = self.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        real_images = torch.as_tensor(real_images, device=device)
        combined_images = torch.concat([generated_images, real_images], axis=0)
        labels = torch.concat([torch.ones((batch_size, 1), device=device),
                               torch.zeros((batch_size, 1), device=device)], axis=0)
        labels += 0.05 * self.uniform(labels.shape, seed=self.seed_generator)
        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        random_latent_vectors = self.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = torch.zeros((batch_size, 1), device=device)
        self.zero_grad()
        predictions = self.discriminator(self.generator(random_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class LossTrackedOnOneRank(LowerLevel):
    """``loss``: the tracker's result on rank 0, the raw batch loss on rank 1 (a log backed by a metric on one
    rank only), and the raw loss as ``batch_loss``: every rank must send the same all-reduce layout. ``overflow``: inf
(a rank with an empty share must not make it inf * 0 = NaN)."""

    def train_step(self, data):
        logs = super().train_step(data)
        raw = self.loss_fn(data[1], self(data[0], training=False))
        rank = int(os.environ.get("RANK", "0"))
        overflow = keras.ops.exp(keras.ops.convert_to_tensor(1000.0))  # inf on every rank, the empty share's too
        return dict(logs, loss=logs["loss"] if rank == 0 else raw, batch_loss=raw, overflow=overflow)


class PerRowLog(CustomModel):
    """Returns its predictions (one per row of this rank's share) as a log: refused, on every rank."""

    def train_step(self, data):
        return dict(super().train_step(data), y_pred=self(data[0], training=False))


class OptimizerInDict(CustomModel):
    """Applies an optimizer kept in a dict (kerasdist finds only the model's optimizer attributes): refused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_name = {"main": keras.optimizers.SGD(0.05)}

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        loss.backward()
        with torch.no_grad():
            self.by_name["main"].apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        return {"loss": loss.detach()}


class GANDataNoise(GAN):
    """The GAN whose random draws come with the data (``fit(x=images, y=noise)``: per row, 4 + 4 latent
    values and a label noise for its fake and its real image), so that one process draws what the ranks draw."""

    def train_step(self, data):
        images, noise = data
        draws = iter([noise[:, :4], noise[:, 4:8]])
        self.normal = lambda shape, seed: next(draws)
        self.uniform = lambda shape, seed: torch.concat([noise[:, 8:9], noise[:, 9:10]], axis=0)
        return super().train_step((images,))


def _functional(cls, seed, bn=False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(32,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if bn:
        hidden = keras.layers.BatchNormalization()(hidden)
    return cls(inputs, keras.layers.Dense(1)(hidden))


def _gan(seed, distribute, cls=GAN):
    keras.utils.set_random_seed(seed)
    discriminator = keras.Sequential([keras.Input((32,)), keras.layers.Dense(8), keras.layers.LeakyReLU(0.2),
                                      keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(32, activation="tanh")])
    gan = cls(discriminator, generator, latent_dim=4)
    gan.compile(d_optimizer=keras.optimizers.SGD(0.05), g_optimizer=keras.optimizers.SGD(0.05),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True), distribute=distribute)
    return gan


def main(args, distribute, batch_logs):
    """Train ``args.guide`` on ``args.rows`` rows in global batches of ``args.batch``; save as the module says."""
    rank = int(os.environ.get("RANK", "0"))
    seed = args.seed + rank  # each rank draws other weights: rank 0's must reach every rank
    rng = np.random.default_rng(0)
    x = rng.random((args.rows, 32)).astype("float32")
    y = rng.random((args.rows, 1)).astype("float32")
    fit = dict(x=x, y=y, batch_size=args.batch, epochs=args.epochs, shuffle=False, verbose=0, callbacks=[batch_logs])
    sgd = keras.optimizers.SGD(0.05)
    if args.guide == "gan":
        model = _gan(seed, distribute)
        fit.pop("y")
    elif args.guide == "gan_data_noise":
        model = _gan(seed, distribute, GANDataNoise)
        fit["y"] = rng.random((args.rows, 10)).astype("float32")
    elif args.guide in ("lower", "tracked_on_one_rank"):
        model = _functional(LowerLevel if args.guide == "lower" else LossTrackedOnOneRank, seed)
        model.compile(optimizer=sgd, distribute=distribute)
    else:
        cls = {"first": CustomModel, "first_bn": CustomModel, "sample_weight": WithSampleWeight,
               "test_step": OwnTestStep, "per_row_log": PerRowLog,
               "optimizer_in_dict": OptimizerInDict}[args.guide]
        model = _functional(cls, seed, bn=args.guide == "first_bn")
        model.compile(optimizer=sgd, loss="mse", metrics=["mae"], distribute=distribute)
        if args.guide == "sample_weight":
            fit["sample_weight"] = rng.random((args.rows, 1)).astype("float32")
    history = model.fit(**fit)
    evaluated = {}  # the GANs have no test step, the lower-level model no compiled loss (Keras's test_step needs it)
    if args.guide not in ("gan", "gan_data_noise", "lower", "tracked_on_one_rank"):
        evaluated = model.evaluate(x, y, batch_size=args.batch, verbose=0, return_dict=True)
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"),
             *[np.asarray(w, dtype="float64") for w in model.get_weights()],
             batch_logs=np.asarray(batch_logs.rows), all_reduces=np.asarray(batch_logs.all_reduces),
             evaluate=np.asarray([float(evaluated[k]) for k in sorted(evaluated)]),
             **{f"history_{k}": np.asarray(v) for k, v in _by_name(history.history).items()})
    print(f"rank {rank} done: {args.guide} {history.history}", flush=True)


def _by_name(history):
    """History with each nested dict of logs (``{"compile_metrics": {"mae": ...}}``) as "compile_metrics.mae"."""
    flat = {}
    for key, values in history.items():
        for name in sorted(values[0]) if isinstance(values[0], dict) else [None]:
            flat[key if name is None else f"{key}.{name}"] = [float(v if name is None else v[name]) for v in values]
    return flat
