"""This process's rank and the number of processes, as the test workers launched by `kerasdist launch` see them:
JAX's process index and count, TensorFlow's TF_CONFIG task, or torch's RANK / WORLD_SIZE."""

import os

import keras


def process_count():
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_count()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank():
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_index()
    if keras.backend.backend() == "tensorflow":
        import kerasdist

        cluster = kerasdist.detect_cluster()
        return 0 if cluster.is_local else cluster.task_index
    return int(os.environ.get("RANK", "0"))


def run_scenarios(out, scenarios, run):
    """``run(scenario)`` for each scenario in turn; one that raises is recorded in OUT-SCENARIO.error-rank{r}.txt
    (for that scenario's own check) and the next one runs. Returns the exit status: 1 if any failed."""
    import traceback

    failed = 0
    for scenario in scenarios:
        try:
            run(scenario)
        except Exception as exc:  # noqa: BLE001  recorded for the scenario's own check
            failed += 1
            traceback.print_exc()
            with open(f"{out}-{scenario}.error-rank{rank()}.txt", "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
        print(f"[scenario {scenario}] done", flush=True)
    return 1 if failed else 0
