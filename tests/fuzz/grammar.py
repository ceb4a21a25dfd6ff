"""``draw_job(seed, backend)``: a whole training job as a JSON-serialisable dict, from ``random.Random`` alone.

Each aspect (data, model, optimizer, ...) is drawn from its own ``random.Random(f"{seed}:{aspect}")`` (Python's
string seeding is a SHA-512 of the string, stable across versions), so growing one aspect's grammar leaves the
other aspects of every seed as they were. Constraints between aspects (a custom step has one input and one output,
validation_split needs arrays, ...) are applied after the draws, by dropping the feature that cannot be.
"""

import random

VERSION = 1
TRUNKS = ("dense", "embedding", "conv1d", "conv2d", "rnn", "attention")
#: name -> learning rate that trains these small models without blowing up
OPTIMIZERS = {"SGD": 0.05, "Adam": 0.01, "AdamW": 0.01, "Adagrad": 0.05, "RMSprop": 0.005, "Adadelta": 1.0,
              "Adamax": 0.01, "Nadam": 0.01, "Ftrl": 0.05, "Lion": 0.001, "Lamb": 0.01, "Muon": 0.01,
              "Adafactor": 0.01}
INPUT_KINDS = ("numpy", "tf_data", "py_dataset", "generator", "dataloader")
POLICIES = {"tensorflow": ("mixed_float16", "mixed_bfloat16"), "jax": ("mixed_bfloat16",),
            "torch": ("mixed_float16", "mixed_bfloat16")}
TASKS = {"regression": ("mse", "mae", "huber"), "sparse": ("sparse_categorical_crossentropy",),
         "binary": ("binary_crossentropy",)}


def _rng(seed, aspect):
    return random.Random(f"{seed}:{aspect}")


def _chance(rng, p):
    return rng.random() < p


def draw_data(seed):
    r = _rng(seed, "data")
    rows = r.randint(24, 72)
    return {"rows": rows, "batch": r.choice((4, 6, 8, 10, 12, 16)), "task": r.choice(tuple(TASKS)),
            "classes": r.randint(2, 4), "second_input": _chance(r, 0.2), "aux_output": _chance(r, 0.2),
            "eval_rows": r.randint(7, 20)}


def draw_model(seed):
    r = _rng(seed, "model")
    model = {"trunk": r.choice(TRUNKS), "units": r.choice((4, 6, 8)), "activation": r.choice(("tanh", "relu")),
             "vocab": r.randint(4, 10), "length": r.randint(3, 6), "channels": r.randint(1, 3),
             "rnn": r.choice(("LSTM", "GRU")), "norm": r.choice((None, None, "batch", "layer")),
             "shared": _chance(r, 0.2), "nested": _chance(r, 0.2), "frozen": _chance(r, 0.15),
             "lora": None}
    if _chance(r, 0.15):
        model["lora"] = {"rank": r.choice((1, 2)), "on": r.choice(("dense", "embedding"))}
    return model


def draw_optimizer(seed):
    r = _rng(seed, "optimizer")
    name = r.choice(sorted(OPTIMIZERS))
    options = {}
    if name == "SGD" and _chance(r, 0.6):
        options.update(momentum=0.9, nesterov=_chance(r, 0.5))
    if _chance(r, 0.2):
        options["weight_decay"] = 0.01
    clip = r.choice((None, None, None, "clipnorm", "global_clipnorm", "clipvalue"))
    if clip:
        options[clip] = 0.5
    if _chance(r, 0.15):
        options.update(use_ema=True, ema_momentum=0.9)
    if _chance(r, 0.15):
        options["gradient_accumulation_steps"] = 2
    return {"name": name, "learning_rate": OPTIMIZERS[name], "options": options, "loss_scale": _chance(r, 0.1)}


def draw_loss(seed, task):
    r = _rng(seed, "loss")
    return {"name": r.choice(TASKS[task]), "sample_weight": _chance(r, 0.25), "class_weight": _chance(r, 0.2)}


def draw_fit(seed):
    r = _rng(seed, "fit")
    return {"input": r.choice(INPUT_KINDS), "epochs": r.randint(2, 3), "shuffle": _chance(r, 0.6),
            "validation": r.choice((None, None, "split", "data")), "steps_per_epoch": _chance(r, 0.15),
            "initial_epoch": r.choice((0, 0, 0, 1))}


def draw_callbacks(seed):
    r = _rng(seed, "callbacks")
    callbacks = []
    if _chance(r, 0.2):
        callbacks.append({"name": "EarlyStopping", "min_delta": r.choice((0.0, 1e9)),
                          "restore_best_weights": _chance(r, 0.5)})
    if _chance(r, 0.2):
        callbacks.append({"name": "ReduceLROnPlateau", "min_delta": r.choice((0.0, 1e9))})
    if _chance(r, 0.2):
        callbacks.append({"name": "ModelCheckpoint", "save_best_only": _chance(r, 0.5)})
    return callbacks


def draw_step(seed):
    r = _rng(seed, "step")
    return {"custom": _chance(r, 0.2), "tracker": r.choice(("loss", "total_loss"))}


def draw_job(seed, backend="tensorflow"):
    """The job of ``seed`` on ``backend``: every choice of the script, as data."""
    data = draw_data(seed)
    policy_rng = _rng(seed, "policy")
    policy = policy_rng.choice(POLICIES[backend]) if _chance(policy_rng, 0.15) else "float32"
    job = {"version": VERSION, "seed": seed, "backend": backend, "data": data, "model": draw_model(seed),
           "optimizer": draw_optimizer(seed), "loss": draw_loss(seed, data["task"]), "policy": policy,
           "fit": draw_fit(seed), "callbacks": draw_callbacks(seed), "step": draw_step(seed)}
    return constrain(job)


def constrain(job):
    """Drop what the other draws make impossible (each rule keeps the job a valid Keras script)."""
    data, model, loss, fit, step = job["data"], job["model"], job["loss"], job["fit"], job["step"]
    if data["task"] == "regression":
        loss["class_weight"] = False
    if step["custom"]:  # keras.io's custom steps: one input, one output, (x, y) batches
        data["second_input"] = data["aux_output"] = False
        loss["sample_weight"] = loss["class_weight"] = False
    if data["aux_output"]:  # class_weight needs a single output
        loss["class_weight"] = False
    if fit["input"] == "dataloader" and data["second_input"]:
        fit["input"] = "numpy"
    if fit["validation"] == "split" and fit["input"] != "numpy":
        fit["validation"] = "data"
    if model["lora"] and model["lora"]["on"] == "embedding" and model["trunk"] != "embedding":
        model["lora"]["on"] = "dense"
    if model["frozen"] and model["lora"]:
        model["frozen"] = False
    return job


def features(job):
    """Short names of what the job uses, for the coverage table."""
    model, opt, fit = job["model"], job["optimizer"], job["fit"]
    found = [f"trunk:{model['trunk']}" + (f"/{model['rnn']}" if model["trunk"] == "rnn" else ""),
             f"optimizer:{opt['name']}", f"input:{fit['input']}", f"policy:{job['policy']}",
             f"loss:{job['loss']['name']}", "step:custom" if job["step"]["custom"] else "step:keras"]
    found += [f"norm:{model['norm']}"] if model["norm"] else []
    found += [f"model:{k}" for k in ("shared", "nested", "frozen") if model[k]]
    found += [f"lora:{model['lora']['on']}"] if model["lora"] else []
    found += [f"option:{k}" for k in sorted(opt["options"]) if k not in ("ema_momentum",)]
    found += ["option:loss_scale"] if opt["loss_scale"] else []
    found += [f"weights:{k}" for k in ("sample_weight", "class_weight") if job["loss"][k]]
    found += [f"data:{k}" for k in ("second_input", "aux_output") if job["data"][k]]
    found += [f"fit:validation_{fit['validation']}"] if fit["validation"] else []
    found += ["fit:shuffle"] if fit["shuffle"] else []
    found += ["fit:steps_per_epoch"] if fit["steps_per_epoch"] else []
    found += ["fit:initial_epoch"] if fit["initial_epoch"] else []
    found += ["fit:uneven_last_batch"] if job["data"]["rows"] % job["data"]["batch"] else []
    found += [f"callback:{c['name']}" for c in job["callbacks"]]
    return found
