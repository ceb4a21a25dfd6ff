"""keras.io's JAX custom-step guides and user data pipelines under data_parallel on JAX, against the same
script in plain Keras (tests/workers/jax_custom_steps.py): one process of 2 host devices, and two processes
of 2 (kerasdist launch -n 2). Each case fits 239 rows in batches of 32 (the last, 15 rows, does not split
over the devices), SGD, 2 epochs."""

import importlib.util
import json
import os
import sys

import pytest

from tests.helpers import ROOT, child_env, python, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                reason="needs jax: pip install 'kerasdist[jax]' (make test installs it)")
WORKER = os.path.join(ROOT, "tests", "workers", "jax_custom_steps.py")
ENV = {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
#: Each trains as one device; over several processes also "unseeded_shuffled_arrays", and
#: "per_process_shuffle" is one clear error.
CASES = ("first_guide", "lower_level_guide", "test_step_guide", "compiled_user_metric", "transfer_learning",
         "model_parallel_guide", "added_losses", "unbuilt_sequential", "own_data_parallel_object",
         "own_model_parallel_object", "weather_callbacks")


def _results(out, processes):
    return [json.loads(open(f"{out}.{rank}").read()) for rank in range(processes)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one") / "steps.json")
    run(python(WORKER, out), timeout=420, env=child_env(**ENV))
    return _results(out, 1)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two") / "steps.json")
    kerasdist_command = os.path.join(os.path.dirname(sys.executable), "kerasdist")
    run([kerasdist_command, "launch", "-n", "2", WORKER, out], timeout=900, env=child_env(**ENV))
    return _results(out, 2)


def _close(logs, plain):
    return logs.keys() == plain.keys() and all(
        abs(a - b) <= 1e-5 * max(1.0, abs(b)) for key in logs
        for a, b in zip(*(v[key] if isinstance(v[key], list) else [v[key]] for v in (logs, plain))))


def _check_as_one_device(result, case, where):
    assert "error" not in result, (where, case, result.get("error"))
    print(f"{where}, {case}: max |dw| vs one device = {result['max_dw']:.3g}")
    assert result["max_dw"] <= 1e-5, (where, case, result["max_dw"])
    assert _close(result["history"], result["plain_history"]), (where, case, result["history"], result["plain_history"])
    assert _close(result["evaluated"], result["plain_evaluated"]), (where, case, result["evaluated"])


@pytest.mark.timeout(480)
def test_custom_steps_trackers_compiled_metrics_and_uneven_batches_on_one_process_of_2_devices(one_process):
    """Before: the lower-level guide's trackers and a compiled BinaryAccuracy crashed ("incompatible devices":
    their variables were not on the mesh); a last batch of 15 rows crashed in make_array_from_process_local_data."""
    (result,) = one_process
    assert result["processes"] == 1 and result["devices"] == 2
    for case in CASES:
        _check_as_one_device(result[case], case, "1 process x 2 devices")
    assert "val_acc" in result["compiled_user_metric"]["history"]  # a validation batch of 239 rows
    assert result["compiled_user_metric"]["predict_diff"] <= 1e-6
    assert result["transfer_learning"]["history"]["base_moved"][0] > 1e-4  # unfrozen: it trained, as one device
    assert result["model_parallel_guide"]["kernel_spec"] == "P(None, 'model')"
    _check_users_distributions_and_writes(result)


def _check_users_distributions_and_writes(result):
    """A user's own DataParallel / ModelParallel (a regex LayoutMap, as the Gemma guide's) as distribute= trains
    as the equivalent spec, an uneven last batch included (before: JAX's IndivisibleError). The weather
    example's callbacks: the files one process writes, each once, by process 0 (before, over 2 processes: a
    raw AssertionError from device_put after process 0's first ModelCheckpoint save)."""
    assert result["own_data_parallel_object"]["kernel_spec"] == "P(None, None)"
    assert result["own_model_parallel_object"]["kernel_spec"] == "P('model', 'batch')"
    weather = result["weather_callbacks"]
    assert len(weather["history"]["loss"]) == 3  # 2 epochs, then the third resumed from the backup
    assert weather["written"] == weather["plain_written"], (weather["written"], weather["plain_written"])
    assert "./best-1.weights.h5" in weather["written"] and "backup/latest.weights.h5" in weather["written"]


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_custom_steps_tf_data_and_evaluate_over_2_processes_equal_one_device_and_every_rank(two_processes):
    """Before: tf.data was refused over several processes, and evaluate failed ("Arguments not recognized:
    {'shuffle': False}")."""
    first, second = two_processes
    assert first["processes"] == 2 and first["devices"] == 4
    for case in CASES + ("unseeded_shuffled_arrays",):
        if case != "unseeded_shuffled_arrays":  # each process's plain run drew its own permutation
            _check_as_one_device(second[case], case, "process 1 of 2")
        _check_as_one_device(first[case], case, "process 0 of 2")
        assert first[case]["history"] == second[case]["history"], case  # logs equal on every rank
        assert first[case]["evaluated"] == second[case]["evaluated"], case
    # a batch axis of 1 over two processes: both feed every row (each fed half once, 0.22 off one device)
    assert first["model_parallel_guide"]["kernel_spec"] == "P(None, 'model')"
    _check_users_distributions_and_writes(first)
    for result in (first, second):  # every process stops with the same clear error
        error = result["per_process_shuffle"]["error"]
        assert error.startswith("fit: KerasdistError") and "read different batches" in error and "seed=S" in error, error
