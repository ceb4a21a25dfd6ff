"""distribute="fsdp" on PyTorch (issue 20, Must show 5): on 2 processes a model built before compile holds half
of its weights and Adam state per process (<= 0.55x of data parallel) and trains as one process does.

Each run is 2 real torch processes with torchrun's variables (the pytest process has TensorFlow's backend).
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from helpers import PYTHON, ROOT, child_env, run, torch_env, torchrun_two

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (pip install torch)")]


def keras_trainer_wraps_ddp():
    from kerasdist.plugin_tools import keras_wraps_ddp

    return keras_wraps_ddp()


#: Keras 3.16's torch trainer wraps the model in DDP itself: there fsdp is one clear error (last test).
on_keras_315 = pytest.mark.skipif(keras_trainer_wraps_ddp(), reason="this Keras's trainer wraps DDP itself")

WORKER = os.path.join(ROOT, "tests", "workers", "torch_fsdp_train.py")
CASES = os.path.join(ROOT, "tests", "workers", "torch_cases.py")


def launch_two(out, word, *flags, worker=None):
    """``worker``'s argv (default: torch_fsdp_train.py OUT WORD FLAGS) in 2 processes with torchrun's variables."""
    return torchrun_two(worker or [WORKER, out, word, *flags])


def load(out, rank=0):
    return np.load(f"{out}-rank{rank}.npz")


def weights(saved):
    return [saved[f"w{i}"] for i in range(sum(name.startswith("w") for name in saved.files))]


def cases(directory, words):
    """torch_cases.py's argv that runs torch_fsdp_train.py for each word (name: its flags) in turn in one process."""
    return [CASES, WORKER, directory, json.dumps([{"name": name, "argv": [os.path.join(directory, name), *word]}
                                                   for name, word in words.items()])]


#: scenarios sharing ONE 2-process run (one torch start-up and rendezvous): both words, then the unbuilt model
#: whose fsdp must raise (last: its error cannot disturb the others)
SHARED = {"data_parallel": ["data_parallel"], "fsdp": ["fsdp"], "saved": ["fsdp", "--save"],
          "lstm_data_parallel": ["data_parallel", "--lstm"], "lstm": ["fsdp", "--lstm"],
          "conv_data_parallel": ["data_parallel", "--conv"], "conv": ["fsdp", "--conv"], "bn": ["fsdp", "--bn"],
          "unbuilt": ["fsdp", "--unbuilt"]}
#: one plain process's scenarios (one start-up): the references
PLAIN = {"plain": ["none"], "bn_plain": ["none", "--bn"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fsdp"))
    run([PYTHON, *cases(directory, PLAIN)], timeout=180, env=child_env(**torch_env()))
    outputs = launch_two(directory, None, worker=cases(directory, SHARED))
    results = {name: os.path.join(directory, name) for name in (*PLAIN, *SHARED)}
    results["outputs"] = [output for _, output in outputs]
    for word in ("data_parallel", "fsdp", "lstm_data_parallel", "lstm", "conv_data_parallel", "conv", "bn"):
        for rank in range(2):
            error = os.path.join(directory, f"{word}.error-rank{rank}.txt")
            assert not os.path.exists(error), f"{word} raised on rank {rank}: {open(error).read()}\n{outputs}"
    return results


@on_keras_315
@pytest.mark.timeout(600)
def test_fsdp_holds_at_most_055x_of_data_parallel_bytes_per_process(runs):
    data_parallel = int(load(runs["data_parallel"])["bytes"])
    for rank in range(2):
        sharded = int(load(runs["fsdp"], rank)["bytes"])
        print(f"rank {rank}: fsdp {sharded} bytes, data_parallel {data_parallel} bytes: {sharded / data_parallel:.3f}x")
        assert sharded <= 0.55 * data_parallel


@on_keras_315
@pytest.mark.timeout(600)
@pytest.mark.parametrize("reference", ["plain", "data_parallel"])
def test_fsdp_trains_as_the_reference_within_1e_5(runs, reference):
    _assert_trains_as(runs[reference], runs["fsdp"])


@on_keras_315
@pytest.mark.timeout(600)
def test_an_lstm_under_fsdp_trains_as_under_data_parallel(runs):
    """The fuzzer's seed 3004: the LSTM's zero initial state (a plain tensor) times a sharded gate is saved plain
    for the backward pass, whose product was DTensor's raw "mixed torch.Tensor and DTensor" error at the first step
    (torch's implicit_replication() inside another one turned the outer one off on its exit)."""
    _assert_trains_as(runs["lstm_data_parallel"], runs["lstm"])


@on_keras_315
@pytest.mark.timeout(600)
def test_a_flatten_after_a_conv_under_fsdp_trains_as_under_data_parallel(runs):
    """The fuzzer's seed 4000: a Dense kernel sharded by rows made DTensor shard the Flatten's 100 features instead
    of the batch; the backward pass could not unflatten them onto a 5 x 5 x 4 map (DTensor's raw "Cannot unflatten
    unevenly sharded tensor"). The trainable weights are now gathered for the call, as FSDP does."""
    _assert_trains_as(runs["conv_data_parallel"], runs["conv"])


@on_keras_315
@pytest.mark.timeout(600)
def test_batch_normalization_under_fsdp_normalizes_with_the_global_batch_as_one_process(runs):
    """Its rows are one sharded tensor, so the batch mean and variance are reductions over every rank's rows: the
    moments (and the moving statistics) of one process's global batch, with no sync_batch_norm option (under
    data_parallel each rank normalizes its own share unless sync_batch_norm=True)."""
    _assert_trains_as(runs["bn_plain"], runs["bn"])


def _assert_trains_as(reference, sharded):
    """Every rank's weights, losses, evaluation and predictions of the fsdp run within 1e-5 of the reference's."""
    expected = load(reference)
    for rank in range(2):
        got = load(sharded, rank)
        difference = max(float(np.abs(a - b).max()) for a, b in zip(weights(expected), weights(got)))
        print(f"rank {rank}: max |w_fsdp - w_reference| = {difference:.3g} ({os.path.basename(reference)})")
        assert difference <= 1e-5
        for key in ("loss", "evaluation", "prediction"):
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)


@on_keras_315
@pytest.mark.timeout(600)
def test_fsdp_checkpoints_and_save_weights_load_into_one_plain_process(runs):
    """ModelCheckpoint (weights only + best only, whole model) and model.save_weights under fsdp on 2 ranks: rank 0
    writes the full weights, which load into a plain model that predicts as the fsdp run (before: rank 1 hit
    HDF5's file lock, rank 0 '.numpy() is not supported for tensor subclasses'). Whole values written into the
    sharded weights, EarlyStopping's restore_best_weights and load_weights, keep each rank's shard of them (the
    fuzzer's seed 5008, before: DTensor's raw "aten.copy_.default got mixed torch.Tensor and DTensor")."""
    import keras

    out = runs["saved"]
    for rank in range(2):
        error = f"{out}.error-rank{rank}.txt"
        assert not os.path.exists(error), f"rank {rank}: {open(error).read()}\n{runs['outputs']}"
    saved = load(out)
    x = np.random.default_rng(0).normal(size=(65, 16)).astype("float32")[:20]
    whole = keras.saving.load_model(f"{out}.keras")
    for path in (f"{out}-best.weights.h5", f"{out}-final.weights.h5"):
        plain = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(6)])
        plain.load_weights(path)
        for model in (plain, whole):
            difference = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), weights(saved)))
            assert difference == 0.0, f"{path}: max |w_loaded - w_fsdp| = {difference}"
            prediction = model.predict(x, batch_size=8, verbose=0)
            assert np.allclose(prediction, saved["prediction"], atol=1e-5), np.abs(prediction - saved["prediction"]).max()


def test_fsdp_on_a_model_without_weights_names_the_fix(runs):
    """A scenario of the shared run: on each rank fsdp raises for a model that has no weights yet."""
    for rank in range(2):
        error = f"{runs['unbuilt']}.error-rank{rank}.txt"
        assert os.path.exists(error), f"fsdp on an unbuilt model raised nothing on rank {rank}:\n{runs['outputs']}"
        with open(error) as f:
            output = f.read()
        assert "fsdp: model" in output and "has no weights yet" in output and "keras.Input" in output, output


@pytest.mark.timeout(300)
@pytest.mark.skipif(not keras_trainer_wraps_ddp(), reason="Keras 3.15's trainer leaves DDP to kerasdist")
def test_fsdp_on_a_keras_whose_trainer_wraps_ddp_is_one_clear_error(tmp_path):
    """Keras 3.16 (make test-keras-nightly): its trainer would wrap the sharded model in DDP (a crash in DDP's
    _sync_module_states) and sum the already global metrics over the ranks."""
    for code, output in launch_two(str(tmp_path / "nightly"), "fsdp"):
        assert code != 0
        assert "fsdp: Keras 3.16" in output and "DistributedDataParallel" in output and "keras>=3.15,<3.16" in output


def test_a_bad_fsdp_option_is_named_at_once():
    import kerasdist

    with pytest.raises(kerasdist.KerasdistError, match=r"fsdp: backend='bogus' is not valid.*gloo"):
        kerasdist.spec("fsdp", backend="bogus")
    with pytest.raises(kerasdist.KerasdistError, match=r"fsdp: timeout_s=0 is not valid"):
        kerasdist.spec("fsdp", timeout_s=0)


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs TensorFlow (this test's backend)")
def test_fsdp_on_tensorflow_names_the_words_that_work_there():
    import keras

    import kerasdist

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(kerasdist.KerasdistError, match=r"needs the Keras backend torch.*KERAS_BACKEND=torch.*mirrored"):
        model.compile(loss="mse", distribute="fsdp")


CONTRACT = """
import keras, torch
from kerasdist.plugin_tools import replace_variable_tensor
variable = keras.Variable(torch.zeros(4), name="v")
tensor = torch.nn.Parameter(torch.arange(4.0))
replace_variable_tensor(variable, tensor)
assert variable.value is tensor, type(variable.value)
assert variable.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
variable.assign(torch.ones(4))
assert variable.value is tensor and tensor.detach().tolist() == [1.0] * 4
print("CONTRACT OK")
"""


@pytest.mark.timeout(120)
def test_keras_torch_variables_read_and_assign_the_tensor_fsdp_puts_in_them():
    """The private Keras contract of _keras_internals/torch_sharding.py: a torch Variable's ``_value``."""
    result = run([PYTHON, "-c", CONTRACT], timeout=100, env=child_env(**torch_env()))
    assert "CONTRACT OK" in result.stdout


def test_backup_and_restore_under_fsdp_is_one_clear_error_naming_the_fix(tmp_path):
    """fsdp's fit callbacks (plugins/torch_distributed/callbacks.fsdp_callbacks): BackupAndRestore is refused."""
    import keras

    import kerasdist
    from plugins.torch_distributed.callbacks import fsdp_callbacks

    call_kwargs = {"callbacks": [keras.callbacks.BackupAndRestore(str(tmp_path))]}
    with pytest.raises(kerasdist.KerasdistError, match=r"fsdp: keras.callbacks.BackupAndRestore.*data_parallel"):
        fsdp_callbacks(call_kwargs, 0, None)
