"""Do the ranks agree on what they are doing? (issue 35: ranks that leave the fit they are in).

Every rank of a multi-process word runs the same script, and each collective of a step pairs with the same one in
the other ranks. A rank that skips a call, or calls ``fit`` on another model (a tuner that failed a trial on one
rank only), pairs its collectives with another call's: an abort, a hang, or gradients of two models averaged
together, silently. So at the start of each ``fit``/``evaluate`` and of each epoch the ranks compare one fingerprint:
the model's structure and variable shapes, the call's kind and arguments, the epoch, the process's count of checked
calls and the model's own count of this kind of call, and the tuner's trial where it is known. Each rank writes its
fingerprint into its own row of a (ranks x fields) table; one sum all-reduce (``sum_arrays``, the strategy's own
collective of float64 arrays) gives every rank the whole table, so the error names both sides.

``predict`` is not checked: on several words it is a local call, which a rank may make alone (rank 0 in a callback).
"""

import hashlib
import re
import weakref

from . import process_state
from .errors import KerasdistError

#: The call arguments that decide how many collectives a call makes.
CALL_ARGUMENTS = ("batch_size", "epochs", "initial_epoch", "steps_per_epoch", "steps", "validation_steps",
                  "validation_freq", "validation_batch_size", "shuffle")
METHODS = ("fit", "evaluate", "predict")
NAME_CHARACTERS = 24
_FIELDS = ("method", "call", "model_call", "epoch", "trial")  # then 4 + 4 digest pieces, then the model's name
_DIGESTS = 8


def _new_counts():
    return {"calls": 0, "by_model": weakref.WeakKeyDictionary()}


def check_agreement(method, model, call_kwargs, *, rank, size, sum_arrays, word, epoch_check="begin"):
    """Raise one :class:`KerasdistError` on every rank unless all ``size`` ranks start the same call: call it in
    every rank's ``fit``/``evaluate`` before its first collective; ``fit`` then checks again at each epoch's start
    (a callback added to ``call_kwargs``). ``sum_arrays(*arrays)`` returns the ranks' sums of float64 arrays (as
    :func:`kerasdist.plugin_tools.same_everywhere` takes it). ``epoch_check="end"``: the next epoch is checked at
    the end of the one before (``on_epoch_end``, not after the last), for a backend whose fit makes collectives
    between two epochs before ``on_epoch_begin`` (JAX over several processes: resetting the metrics places their
    zeros on the global mesh)."""
    if size < 2 or method not in ("fit", "evaluate"):
        return
    counts = process_state.slot("kerasdist.agreement_counts", _new_counts)
    counts["calls"] += 1
    by_model = counts["by_model"].setdefault(model, {})
    by_model[method] = by_model.get(method, 0) + 1
    call = _Call(method, model, call_kwargs, counts["calls"], by_model[method], rank, size, sum_arrays, word)
    call.check(epoch=None)
    if method == "fit":
        import keras

        if epoch_check == "end":
            class EpochAgreement(keras.callbacks.Callback):
                def on_epoch_end(self, epoch, logs=None):
                    if epoch + 1 < (self.params or {}).get("epochs", 0):
                        call.check(epoch + 1)
        else:
            class EpochAgreement(keras.callbacks.Callback):
                def on_epoch_begin(self, epoch, logs=None):
                    call.check(epoch)

        if isinstance(call_kwargs.get("callbacks"), list):  # kerasdist's own copy of the user's list
            call_kwargs["callbacks"].append(EpochAgreement())
        else:
            call_kwargs["callbacks"] = list(call_kwargs.get("callbacks") or []) + [EpochAgreement()]


class _Call:
    def __init__(self, method, model, call_kwargs, call, model_call, rank, size, sum_arrays, word):
        self.fields = [METHODS.index(method), call, model_call, -1, _tuner_trial(call_kwargs)]
        self.digests = [*_digest(_structure(model)), *_digest(_arguments(call_kwargs))]
        self.name = [float(ord(c)) for c in str(getattr(model, "name", ""))[:NAME_CHARACTERS]]
        self.name += [0.0] * (NAME_CHARACTERS - len(self.name))
        self.rank, self.size, self.sum_arrays, self.word = rank, size, sum_arrays, word

    def check(self, epoch):
        import numpy as np

        fields = list(self.fields)
        fields[3] = -1 if epoch is None else int(epoch)
        row = np.array(fields + self.digests + self.name, dtype=np.float64)
        table = np.zeros((self.size, row.size), dtype=np.float64)
        table[self.rank] = row
        table = np.asarray(self.sum_arrays(table)[0], dtype=np.float64).reshape(table.shape)
        compared = len(_FIELDS) + _DIGESTS
        differ = [r for r in range(self.size) if not np.array_equal(table[r, :compared], table[0, :compared])]
        if differ:
            raise disagreement_error(self.word, table, differ[0])


def disagreement_error(word, table, other):
    """The error naming rank ``other``'s call and rank 0's (rows of the gathered table)."""
    first, second = table[other], table[0]
    size = len(_FIELDS)
    what = [name for name, a, b in (("the model (its layers or variable shapes)", first[size:size + 4],
                                     second[size:size + 4]),
                                    ("the call's arguments", first[size + 4:size + 8], second[size + 4:size + 8]))
            if not (a == b).all()]
    detail = f" ({' and '.join(what)} differ)" if what else ""
    trials = (int(first[4]), int(second[4]))
    tuner = (f"rank {other} is in trial {trials[0]}, rank 0 in trial {trials[1]}: "
             if min(trials) >= 0 and trials[0] != trials[1] else "")
    return KerasdistError(
        f"distribute={word!r}: the ranks are not in the same call: {tuner}rank {other} is in {describe(first)}, "
        f"rank 0 in {describe(second)}{detail}. Their collectives would pair across calls (an abort, a hang, or "
        "two models' gradients averaged together). Every rank must make the same fit/evaluate calls, in the same "
        "order, on the same model: nothing may fail, skip or add a call on one rank only (a tuner: give each rank "
        "the same oracle seed, e.g. keras.utils.set_random_seed(S) before building it, and let a trial that fails "
        "on one rank fail on all; only the chief should write the tuner's files).")


def describe(row):
    """'fit #3 of model 'trial_2' (epoch 0), call 7 of this process' from a table row."""
    size = len(_FIELDS) + _DIGESTS
    name = "".join(chr(int(c)) for c in row[size:] if c > 0)
    epoch = f" (epoch {int(row[3])})" if row[3] >= 0 else " (its start)"
    return f"{METHODS[int(row[0])]} #{int(row[2])} of model {name!r}{epoch}, call {int(row[1])} of its process"


def _structure(model):
    """The model's class, its layers' classes and each variable's shape, dtype and trainability (not names: a rank
    that made one more model elsewhere numbers its layers differently)."""
    layers = [type(layer).__name__ for layer in getattr(model, "layers", ())]
    variables = [(tuple(int(d) for d in v.shape), str(v.dtype), bool(v.trainable))
                 for v in getattr(model, "weights", ())]
    return type(model).__name__, layers, variables


def _arguments(call_kwargs):
    return [(name, repr(call_kwargs.get(name))) for name in CALL_ARGUMENTS] + [
        ("validation", call_kwargs.get("validation_data") is not None or bool(call_kwargs.get("validation_split")))]


def _digest(value):
    """48 bits of a digest of ``value``'s repr as four 12-bit float64 pieces (exact in any sum of ranks' rows)."""
    bits = int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:6], "little")
    return [float((bits >> shift) & 0xFFF) for shift in (0, 12, 24, 36)]


def _tuner_trial(call_kwargs):
    """The KerasTuner trial a fit belongs to (its SaveBestEpoch callback writes under ``trial_<id>``), or -1."""
    for callback in call_kwargs.get("callbacks") or ():
        if type(callback).__module__.startswith("keras_tuner"):
            found = re.search(r"trial_(\d+)", str(getattr(callback, "filepath", "")))
            if found:
                return int(found.group(1))
    return -1
