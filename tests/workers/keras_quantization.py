"""Keras's own quantization under a strategy word (issue 36): float8 training (``model.quantize("float8")``, then
compile + fit) and an int8 / int4 LoRA fine-tune (a float-trained model, ``model.quantize("int8")``, then
``layer.enable_lora(rank=4)`` on its Dense layers, as KerasHub's QLoRA guide does), each trained with and without
the word on the same global batches. One process start runs every scenario named on the command line and writes
OUT-SCENARIO-rank{r}.npz (every weight of the model, scales and amax histories included, gathered whole) and .json
(losses). A scenario that raises is recorded in OUT-SCENARIO.error-rank{r}.txt and the next one runs.

    KERASDIST_CPU_REPLICAS=2 python keras_quantization.py OUT one-float8 mirrored-float8 ...     (TensorFlow)
    kerasdist launch -n 2 -- keras_quantization.py OUT multiworker-int8lora ...                 (TensorFlow)
    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=2 python keras_quantization.py OUT ...
    KERAS_BACKEND=torch OMP_NUM_THREADS=1 kerasdist launch -n 2 -- keras_quantization.py OUT data_parallel-float8

SCENARIO is WORD-MODE[-plugin]: WORD one (distribute=None), mirrored, central_storage, multiworker, data_parallel,
fsdp, hybrid; MODE float8, float8nobias (Dense layers without bias: Keras's float8 Dense rounds its bias to
bfloat16 in the forward pass, so a bias gradient is rounded per replica), int8lora, int4lora; ``-plugin`` gives the quantization as kerasdist's spec in the list
(``[word, kerasdist.float8()]`` / ``[word, kerasdist.qlora(rank=4, mode=...)]``) instead of calling Keras before
compile.
"""

import kerasdist  # noqa: I001  first: joins a multi-worker cluster before any TensorFlow op
from process_ranks import process_count, rank, run_scenarios  # noqa: E402

import json
import os
import sys
import time

import keras
import numpy as np

BATCH = 32  # global batch
ROWS = 128  # 4 steps an epoch (8 in all): the float8 maxima differ from the first step when not reduced
EPOCHS = 2
PRETRAIN_EPOCHS = 2


def data():
    """Random inputs with a learnable 10-class target (no download, identical in every process)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 64)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(64, 10)), axis=-1).astype("int32")
    return x, y


def mlp(use_bias=True):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(128, activation="relu", use_bias=use_bias, name="d1"),
                             keras.layers.Dense(10, use_bias=use_bias, name="d2")])


def pretrained_weights():
    """The float model both sides fine-tune: trained the same way (plain Keras) in every process."""
    x, y = data()
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(x, y, batch_size=BATCH, epochs=PRETRAIN_EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def distribute(word):
    if word == "one":
        return None
    if word == "hybrid":
        return kerasdist.hybrid(mesh={"batch": 1, "model": 2}, min_shard_size=0)
    return word


def build(mode, plugin, pretrained):
    """The model and the optimization spec (None when Keras is called before compile)."""
    model = mlp(use_bias=mode != "float8nobias")
    if mode.startswith("float8"):
        if plugin:
            return model, kerasdist.spec("float8")
        model.quantize("float8")
        return model, None
    model.set_weights(pretrained)
    keras_mode = mode.replace("lora", "")
    if plugin:
        return model, kerasdist.spec("qlora", rank=4, mode=keras_mode)
    model.quantize(keras_mode)
    for layer in model.layers:
        layer.enable_lora(rank=4)
    return model, None


def train(scenario, pretrained=None):
    """Train one scenario; ``({index:path: whole value}, info)``."""
    word, mode, *extra = scenario.split("-")
    plugin = extra == ["plugin"]
    x, y = data()
    started = time.monotonic()
    model, spec = build(mode, plugin, pretrained if pretrained is not None or "lora" not in mode
                        else pretrained_weights())
    words = distribute(word)
    if spec is not None:
        words = spec if words is None else [words, spec]
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=_loss(), distribute=words)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    weights = {f"{i}:{v.path.split('/', 1)[-1]}": np.asarray(keras.ops.convert_to_numpy(_whole(v)))
               for i, v in enumerate(model.weights)}
    info = {"loss": [float(v) for v in history.history["loss"]], "seconds": time.monotonic() - started,
            "trainable": [v.path.split("/", 1)[-1] for v in model.trainable_weights],
            "modes": {layer.name: layer.quantization_mode for layer in model.layers},
            "lora": {layer.name: layer.lora_enabled for layer in model.layers}, "processes": process_count()}
    return weights, info


def run(out, scenario, pretrained):
    weights, info = train(scenario, pretrained)
    name = f"{out}-{scenario}-rank{rank()}"
    np.savez(name + ".npz", **weights)
    with open(name + ".json", "w") as f:
        json.dump(info, f)
    print(f"[{scenario}] loss {info['loss']} {info['seconds']:.1f} s", flush=True)


def max_diff(got, want):
    """The largest |difference| over every variable (by position), and the variable where it is."""
    worst = (0.0, None)
    for (key, a), b in zip(sorted(got.items(), key=_position), (v for _, v in sorted(want.items(), key=_position))):
        assert a.shape == b.shape, (key, a.shape, b.shape)
        diff = float(np.max(np.abs(a.astype("float64") - b.astype("float64")))) if a.size else 0.0
        worst = max(worst, (diff, key), key=lambda t: t[0])
    return worst


def _position(item):
    return int(item[0].split(":", 1)[0])


def _whole(variable):
    """The whole value of a variable (torch fsdp: a DTensor shard; JAX: an array over several processes)."""
    value = variable.value
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    if keras.backend.backend() == "jax":
        import jax

        if not getattr(value, "is_fully_addressable", True):
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(value, tiled=True)
    return value


def main(argv):
    """``OUT SCENARIO...`` (also torch_cases.py's entry)."""
    out, scenarios = argv[0], argv[1:]
    pretrained = pretrained_weights() if any("lora" in s for s in scenarios) else None
    return run_scenarios(out, scenarios, lambda scenario: run(out, scenario, pretrained))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
