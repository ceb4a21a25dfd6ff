"""The model half of a job's script: ``make_model()`` (a functional model from the job's grammar) and, for a custom
step, the ``CustomStep`` class written as keras.io's "Customizing what happens in fit()" guide for the backend
writes it, with a loss that is not a ``keras.losses.Loss`` (``ops.mean``) and its own tracker."""

#: the custom step's loss, by task (y_pred are logits)
USER_LOSS = {
    "regression": "ops.mean(ops.square(y - y_pred))",
    "sparse": "ops.mean(keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True))",
    "binary": "ops.mean(keras.losses.binary_crossentropy(y, y_pred, from_logits=True))",
}

_COMMON = '''class CustomStep(keras.Model):
    """keras.io's lower-level custom step: its own loss function and tracker, a ``metrics`` property."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name={tracker!r})

    @property
    def metrics(self):
        return [self.loss_tracker]

    def user_loss(self, y, y_pred):
        return {loss}
'''

_TF_STEPS = '''
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.user_loss(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}
'''

_TORCH_STEPS = '''
    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = self.user_loss(y, self(x, training=True))
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}
'''

_EAGER_TEST_STEP = '''
    def test_step(self, data):
        x, y = data
        self.loss_tracker.update_state(self.user_loss(y, self(x, training=False)))
        return {"loss": self.loss_tracker.result()}
'''

_JAX_STEPS = '''
    def loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        return self.user_loss(y, y_pred), non_trainable_variables

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (loss, non_trainable_variables), grads = grad_fn(trainable_variables, non_trainable_variables, x, y, True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        metrics_variables = self.loss_tracker.stateless_update_state(metrics_variables, loss)
        logs = {"loss": self.loss_tracker.stateless_result(metrics_variables)}
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables)

    def test_step(self, state, data):
        trainable_variables, non_trainable_variables, metrics_variables = state
        x, y = data
        loss, non_trainable_variables = self.loss_and_updates(trainable_variables, non_trainable_variables, x, y,
                                                              False)
        metrics_variables = self.loss_tracker.stateless_update_state(metrics_variables, loss)
        logs = {"loss": self.loss_tracker.stateless_result(metrics_variables)}
        return logs, (trainable_variables, non_trainable_variables, metrics_variables)
'''


def custom_step_source(job):
    """The ``CustomStep`` class of ``job``'s backend (empty when the job uses Keras's own step)."""
    if not job["step"]["custom"]:
        return ""
    head = _COMMON.format(tracker=job["step"]["tracker"], loss=USER_LOSS[job["data"]["task"]])
    steps = {"tensorflow": _TF_STEPS + _EAGER_TEST_STEP, "torch": _TORCH_STEPS + _EAGER_TEST_STEP,
             "jax": _JAX_STEPS}[job["backend"]]
    return head + steps


def input_shape(job):
    """Shape of one row of input "a" (without the batch axis), and whether it holds integer ids."""
    model = job["model"]
    trunk, length, channels = model["trunk"], model["length"], model["channels"]
    if trunk == "dense":
        return (5,), False
    if trunk == "embedding":
        return (length,), True
    if trunk == "conv2d":
        return (length, length, channels), False
    return (length, channels), False


def output_units(job):
    data = job["data"]
    return {"regression": data["classes"], "sparse": data["classes"], "binary": 1}[data["task"]]


def _trunk_lines(model):
    units, act = model["units"], repr(model["activation"])
    trunk = model["trunk"]
    lines = {
        "dense": [],
        "embedding": [f'h = layers.Embedding({model["vocab"]}, {units}, name="embedding")(h)',
                      "h = layers.GlobalAveragePooling1D()(h)"],
        "conv1d": [f'h = layers.Conv1D({units}, 2, padding="same", activation={act}, name="conv")(h)',
                   "h = layers.GlobalAveragePooling1D()(h)"],
        "conv2d": [f'h = layers.Conv2D({units}, 2, padding="same", activation={act}, name="conv")(h)',
                   "h = layers.Flatten()(h)"],
        "rnn": [f'h = layers.{model["rnn"]}({units}, name="rnn")(h)'],
        # no biases: the key bias's gradient is 0 in exact arithmetic (a softmax ignores a shift shared by every
        # key), so it trains on rounding noise alone, which an adaptive optimizer scales to full steps
        "attention": ['h = layers.MultiHeadAttention(2, 4, use_bias=False, name="attention")(h, h)',
                      "h = layers.GlobalAveragePooling1D()(h)"],
    }[trunk]
    # before a BatchNormalization a bias's gradient is 0 in exact arithmetic (the batch mean removes it): no bias
    bias = ", use_bias=False" if model["norm"] == "batch" else ""
    return lines + [f'h = layers.Dense({units}, activation={act}{bias}, name="dense_1")(h)']


def model_source(job):
    """``def make_model():`` for ``job``: functional, weights set from a NumPy generator (the same start under
    every word, whatever Keras's own seeding does under a strategy)."""
    model, data = job["model"], job["data"]
    units, act = model["units"], repr(model["activation"])
    shape, ids = input_shape(job)
    lines = [f'a = keras.Input(shape={shape!r}, name="a"' + (', dtype="int32")' if ids else ")"), "h = a"]
    lines += _trunk_lines(model)
    if model["norm"]:
        norm = {"batch": "BatchNormalization", "layer": "LayerNormalization"}[model["norm"]]
        lines.append(f'h = layers.{norm}(name="norm")(h)')
    if model["shared"]:
        lines += [f'shared = layers.Dense({units}, activation={act}, name="shared")', "h = shared(shared(h))"]
    if model["nested"]:
        lines.append(f"inner = keras.Sequential([layers.Dense({units}, activation={act}), layers.Dense({units})], "
                     'name="inner")')
        lines.append("h = inner(h)")
    inputs = "a"
    if data["second_input"]:
        lines += ['b = keras.Input(shape=(3,), name="b")',
                  f'h = layers.Concatenate()([h, layers.Dense({units}, name="dense_b")(b)])']
        inputs = '{"a": a, "b": b}'
    lines.append(f'out = layers.Dense({output_units(job)}, name="out", dtype="float32")(h)')
    outputs = "out"
    if data["aux_output"]:
        lines.append('aux = layers.Dense(1, name="aux", dtype="float32")(h)')
        outputs = '{"out": out, "aux": aux}'
    cls = "CustomStep" if job["step"]["custom"] else "keras.Model"
    lines.append(f"model = {cls}({inputs}, {outputs})")
    if model["lora"]:
        layer = "embedding" if model["lora"]["on"] == "embedding" else "dense_1"
        lines.append(f'model.get_layer("{layer}").enable_lora({model["lora"]["rank"]})')
    if model["frozen"]:
        lines.append('model.get_layer("dense_1").trainable = False')
    lines.append(f"set_start_weights(model, {job['seed'] + 1})")
    lines.append("return model")
    return "def make_model():\n" + "".join(f"    {line}\n" for line in lines)


SET_START_WEIGHTS = '''def set_start_weights(model, seed):
    """Every float weight from one NumPy generator (normalisation scales 1, offsets and means 0)."""
    rng = np.random.default_rng(seed)
    values = []
    for variable, value in zip(model.weights, model.get_weights()):
        name = variable.path
        if not np.issubdtype(value.dtype, np.floating):
            values.append(value)
        elif "gamma" in name or "variance" in name:
            values.append(np.ones_like(value))
        elif "beta" in name or "mean" in name:
            values.append(np.zeros_like(value))
        else:
            values.append(rng.normal(0.0, 0.3, size=value.shape).astype(value.dtype))
    model.set_weights(values)
'''
