import os
import re
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The in-process tests use 2 logical CPU replicas; subprocess tests set their own environment.
os.environ.setdefault("KERASDIST_CPU_REPLICAS", "2")

import pytest  # noqa: E402

import kerasdist  # noqa: E402,F401  (splits the CPU before any TF op)
from kerasdist import process_state  # noqa: E402
from kerasdist.manager import PluginSystem, get_system, reset_system  # noqa: E402


@pytest.fixture
def fresh_system(monkeypatch):
    """A plugin system without entry points, installed process-wide for the test only: the process state
    (strategy cache, plugin caches) is reset before and after, so nothing the test's plugins made leaks."""
    previous = get_system()
    process_state.reset()
    system = PluginSystem(environ={}, load_entrypoints=False)
    reset_system(system)
    yield system
    process_state.reset()
    reset_system(previous)


@pytest.fixture
def system():
    return get_system()


def pytest_sessionfinish(session, exitstatus):
    """Remove the folder the child processes of this test process kept their fit backups in (tests/helpers.py)."""
    for name in ("helpers", "tests.helpers"):
        root = getattr(sys.modules.get(name), "BACKUP_ROOT", None)
        if root:
            shutil.rmtree(root, ignore_errors=True)


_LEGACY_KERAS_AT_START = os.environ.get("TF_USE_LEGACY_KERAS")


@pytest.fixture(autouse=True)
def keras_3_stays_tf_keras():
    """A test must not leave TF_USE_LEGACY_KERAS set in this process (importing tensorflow_model_optimization
    or Ray's TensorFlow worker set-up do): every later test in the same pytest worker would get Keras 2 as tf.keras."""
    yield
    leaked = os.environ.get("TF_USE_LEGACY_KERAS")
    if leaked != _LEGACY_KERAS_AT_START:
        if _LEGACY_KERAS_AT_START is None:
            os.environ.pop("TF_USE_LEGACY_KERAS", None)
        else:
            os.environ["TF_USE_LEGACY_KERAS"] = _LEGACY_KERAS_AT_START
        pytest.fail(f"this test left TF_USE_LEGACY_KERAS={leaked!r} in the test process: later tests would get "
                    "Keras 2 as tf.keras (import tensorflow_model_optimization only in a child process)")


#: the files that run longest (wall seconds of one xdist worker, measured 2026-11-29 with --durations), started
#: first: `make test` runs files on 2 xdist workers in collection order (--dist loadfile), so a long file collected
#: last runs alone at the end
LONGEST_FIRST = ("test_equivalence.py", "test_multiworker_strategy_free.py", "test_multiworker.py", "test_torch.py",
                 "test_qat.py", "test_horovod.py", "test_mirrored.py", "test_tf_word_findings.py", "test_fuzz.py", "test_guide_words.py",
                 "test_hooks.py", "test_multiworker_row_counts.py", "test_jax_custom_steps.py", "test_replica_semantics.py",
                 "test_guide_seed_tutorials.py", "test_guide_multi_worker.py", "test_slurm_real.py", "test_jax.py")


#: `make test-extended` (KERASDIST_EXTENDED_TESTS=1) also runs the tests marked `extended`: multi-process runs that
#: repeat, on more processes or another launcher, what a test of `make test` already checks (kept out of its 25
#: minutes; `.ci/run` runs both tiers)
EXTENDED = os.environ.get("KERASDIST_EXTENDED_TESTS") == "1"

#: tests of the extended tier that live in files of `make test`: node id pattern -> what checks the same in make test
#: (loaded seconds of each, measured 2026-11-29)
EXTENDED_HERE = {
    r"tests/test_fuzz\.py::test_seed_2002_attention_under_fsdp_trains_or_names_the_uneven_batch":
        "the torch group's fsdp runs of seed 1000 (uneven batches) in the short tier (40 s)",
    r"tests/test_tf_word_findings\.py::test_(multiworker_trains_and_logs_as_one_process|horovod)":
        "mirrored's and central_storage's run of the same jobs (MWMS: the same replica-context code) (150 s)",
    r"tests/test_jax_custom_steps\.py::test_custom_steps_tf_data_and_evaluate_over_2_processes":
        "the same cases on 1 process x 2 devices (322 s)",
    r"tests/guides/test_guide_words\.py::\w+\[(mirrored|central_storage|multiworker|horovod|jax-data_parallel)[-\]]":
        "the same guides under torch data_parallel, and the equivalence matrix's rows of these words (900 s)",
    r"tests/test_equivalence\.py::test_same_steps_weights_and_val_loss_as_plain_keras\[multiworker_mwms-":
        "the multiworker row (strategy-free step); MWMS's step in test_multiworker's transports (157 s)",
    r"tests/test_equivalence\.py::test_a_loss_scale_overflow_on_one_(worker_is_skipped_by_every_worker\[ring\]|horovod)":
        "the same overflow over kerasdist's TCP ring, and under the strategy-free step (68 s)",
    r"tests/test_ray\.py::test_ray_train_gets_metrics_and_checkpoints_and_a_retry":
        "Ray's TorchTrainer test; the retry's resume is BackupAndRestore's, tested under launch (150 s)",
    r"tests/test_torch\.py::test_sigkilled_worker":
        "test_multiworker's killed worker resumes from the backup (132 s)",
    r"tests/guides/test_guide_multi_worker\.py::test_tutorial_with_tf_config_set_by_hand":
        "the same tutorial under kerasdist launch; TF_CONFIG parsing in test_cluster_env (89 s)",
    r"tests/test_multiworker\.py::test_built_in_methods_guide_under_the_strategy_step":
        "the guide under torch; MWMS's step in test_multiworker's transports (79 s)",
    r"tests/test_keras_nightly_gate\.py::test_(multiworker_both_steps_under_launch|torch_words_on_two_ranks)":
        "the next Keras in one process per backend; make test-keras-nightly runs the whole suite on it (65 s)",
    r"tests/test_jax\.py::test_launch_2_processes_of_4_devices":
        "the equivalence matrix's jax_processes row, and the 2x4 mesh in one process (70 s)",
    r"tests/test_qat\.py::test_(qat_recovers_what_per_tensor|two_of_four_pruning_keeps_accuracy)":
        "QAT's accuracy on digits in the LiteRT file, and 2:4 in test_pruning (71 s)",
    r"tests/test_transport_probe\.py::test_auto_probes_both_transports_and_every_worker_uses_rank_0s_choice\[at-fit\]":
        "the same probe at compile (27 s)",
    r"tests/test_multiworker_strategy_free\.py::test_workers_with_different_strategy_free_settings_fail_at_compile_naming_each\[auto":
        "the same refusal for on/off (21 s)",
    r"tests/test_horovod\.py::test_check_build_shows_tensorflow_and_gloo":
        "every horovodrun launch of test_horovod needs TensorFlow and Gloo in the build (52 s)",
    r"tests/test_multiworker_row_counts\.py::":
        "the equivalence matrix's multiworker row: uneven last batches of every input kind (108 s)",
    r"tests/test_central_storage\.py::test_a_py_dataset_trains_in_one_processs_shuffled_order":
        "the same under mirrored, and the matrix's input_py_dataset column (25 s)",
    r"tests/test_multiworker\.py::test_tf_data_input_is_sharded_and_equals_single_process_on_the_global_batch":
        "the equivalence matrix's multiworker / input_tf_data cell (38 s)",
    r"tests/test_slurm_real\.py::test_torch_tasks_of_an_srun_step_form_one_group":
        "srun's TensorFlow tasks as one job; torch's rendezvous from Slurm's variables in test_cluster_env (34 s)",
    r"tests/test_multiworker_strategy_free\.py::test_strategy_free_training_equals_one_process_on_the_global_batch":
        "the equivalence matrix's multiworker row (the strategy-free step: every input kind, uneven batches) (78 s)",
    r"tests/test_tcp_ring\.py::test_sums_are_exact_and_identical_on_every_rank\[3\]":
        "the same sums over 2 ranks (24 s)",
    r"tests/test_equivalence\.py::test_same_steps_weights_and_val_loss_as_plain_keras\[jax_processes-":
        "the jax_data_parallel row (the same columns on 1 process x 2 devices), and test_no_tensorflow's launch of "
        "2 JAX processes (137 s)",
    r"tests/guides/test_guide_(horovod|parameter_server|tfmot)\.py::":
        "the equivalence matrix's horovod row and test_horovod's suite; test_ps; test_pruning and test_qat (178 s)",
    r"tests/test_multiworker\.py::test_(both_gradient_transports_equal_single_process_training\[tcp|worker_killed_in)":
        "the TCP ring in test_tcp_ring and the overflow test; BackupAndRestore's resume in test_backup (84 s)",
    r"tests/test_ps\.py::test_servers_exit_by_themselves_when_the_coordinator_is_killed":
        "test_ps's two launches end their servers (20 s)",
    r"tests/test_fuzz\.py::test_a_drawn_job_trains_as_one_process_or_is_refused\[(tf_multiworker|jax_local)-":
        "the short tier's TF in-process and torch groups; the matrix's multiworker and JAX rows (80 s)",
    r"tests/test_mirrored(_inputs)?\.py::test_(a_py_dataset_trains_in_one_processs_shuffled_order|tutorial_flow_callbacks)":
        "the matrix's mirrored / input_py_dataset cell; test_save_load_word and test_backup (96 s)",
    r"tests/test_multiworker_strategy_free\.py::test_a_loss_scale_overflow_on_one_worker_is_skipped":
        "the same overflow in test_equivalence over the TCP ring (30 s)",
    r"tests/test_multiworker\.py::test_both_gradient_transports_equal_single_process_training\[ring":
        "MultiWorkerMirroredStrategy's step: a non-default path (sync_batch_norm=True or KERASDIST_STRATEGY_FREE=off) "
        "(42 s)",
    r"tests/test_horovod\.py::test_failures_end_the_job_fast\[crash":
        "a crashing rank ends multiworker and torch jobs in their suites (30 s)",
    r"tests/test_qat\.py::test_(qat_on_digits_stays_within_half_a_point|multiworker_qat_equals_one_process)":
        "the mirrored QAT test and test_export_backends' QAT exports (76 s)",
    r"tests/test_keras_nightly_gate\.py::":
        "make test-keras-nightly runs the whole suite on the next Keras (54 s)",
    r"tests/test_transport_probe\.py::test_auto_probes_both_transports":
        "the probe's choice and settings in the file's other tests (40 s)",
    r"tests/test_horovod_elastic\.py::":
        "horovod's suite launch; elastic runs add, remove and kill workers (47 s)",
    r"tests/guides/test_guide_multi_worker\.py::":
        "the matrix's multiworker row and test_multiworker's launches (120 s)",
    r"tests/test_equivalence\.py::test_same_steps_weights_and_val_loss_as_plain_keras\[central_storage-":
        "the mirrored row (the same replicas_train_as_one_device in one process) and test_central_storage (61 s)",
    r"tests/test_equivalence\.py::test_same_steps_weights_and_val_loss_as_plain_keras\[horovod-":
        "test_horovod's suite launch under horovodrun: 13 scenarios against one process (72 s)",
    r"tests/test_multiworker\.py::test_launch_runs_the_same_example_to_the_same_weights":
        "the hand-set TF_CONFIG run of the same example; kerasdist launch in the matrix's multiworker row (27 s)",
    r"tests/test_jax\.py::test_data_parallel_on_8_devices_equals_one_device":
        "the matrix's jax_data_parallel row (1x2) and the keras.io JAX guide's 8 devices (32 s)",
    r"tests/test_horovod\.py::test_failures_end_the_job_fast\[mismatch":
        "the same agreement check (plugin_tools.check_agreement) refusing under multiworker and torch (28 s)",
    r"tests/test_keras_tuner\.py::test_a_tuner_searches_under_launch":
        "the writing-callbacks table every word uses, KerasTuner's SaveBestEpoch in it (test_keras_tuner) (3 x 60 s)",
    r"tests/test_torch\.py::test_torchrun_trains_every_keras_io_custom_step":
        "every keras.io custom step under kerasdist launch; two of them and the default model under torchrun (20 s)",
    r"tests/test_torch_sharding\.py::test_fsdp_holds_at_most_055x":
        "fsdp's training and checkpoints in the file's other tests and the fuzzer's torch group (48 s)",
    r"tests/test_ray\.py::test_ray_torch_trainer":
        "Ray Train's TorchTrainer beside the file's TensorFlow trainer run (extended too); torch data_parallel under "
        "kerasdist launch and torchrun in test_torch (73 s)",
    r"tests/guides/test_guide_keras_multi_gpu\.py::":
        "the matrix's mirrored row; test_save_load_word's restore of the guides' checkpoint on two replicas (59 s)",
    r"tests/test_hooks\.py::test_hook_kerasdist_keras_imported$":
        "the same hook heard at registration in this process (test_hook_kerasdist_keras_imported_is_historic) (20 s)",
    r"tests/test_plugin_loading\.py::test_keras_is_patched_and_the_cpu_split_whichever":
        "every test process imports kerasdist, then keras, then TensorFlow; test_hooks' keras_imported hook in both "
        "orders (31 s)",
}


def pytest_collection_modifyitems(session, config, items):
    """Files in LONGEST_FIRST first (in that order), then the rest as collected; tests keep their order in a file.
    Tests marked `extended` (or listed in EXTENDED_HERE) are skipped unless KERASDIST_EXTENDED_TESTS=1."""
    patterns = [re.compile(pattern) for pattern in EXTENDED_HERE]
    for item in items:
        if any(pattern.match(item.nodeid) for pattern in patterns):
            item.add_marker(pytest.mark.extended)
    if not EXTENDED:
        skip = pytest.mark.skip(reason="extended tier: make test-extended (KERASDIST_EXTENDED_TESTS=1)")
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(skip)
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), position[id(item)]))
