"""An elastic training script for tests/test_horovod_elastic.py, run under
`horovodrun --gloo --min-np 1 --max-np 2 --host-discovery-script ...` on loopback.

    hvd_elastic.py OUTDIR HOSTS_FILE PLAN TOKEN

The discovery script prints HOSTS_FILE. PLAN is a comma-separated list of ``EPOCH:ACTION``: rank 0,
at the end of epoch EPOCH (1-based, before the commit), does ACTION: ``hosts=N`` writes N hosts of
one slot (``localhost``, ``127.0.0.1``) to HOSTS_FILE and waits until Horovod has told this worker
(so the commit of that epoch raises HostsUpdatedInterrupt on every worker); ``kill``: rank 0 kills the worker of rank
1 (SIGKILL) after the second batch of epoch EPOCH.
Every worker appends one JSON line per event to OUTDIR/events.jsonl.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import kerasdist  # noqa: E402  (first: hvd.init() at import under horovodrun)
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_common as common  # noqa: E402
from kerasdist_plugins import horovod as plugin  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

EPOCHS = 7
#: Two host names for loopback, one slot each: Horovod blacklists a whole host when a worker on it
#: fails, so a worker is killed on its own "host".
HOSTS = {"1": "localhost:1\n", "2": "localhost:1\n127.0.0.1:1\n"}


def main(outdir, hosts_file, plan):
    actions = {int(k): v for k, v in (item.split(":") for item in plan.split(",") if item)}
    events = os.path.join(outdir, "events.jsonl")

    def log(**event):
        event.update(pid=os.getpid(), rank=hvd.rank(), size=hvd.size(), time=time.time())
        with open(events, "a") as f:
            f.write(json.dumps(event) + "\n")

    model = common.build_model()
    # Rank-dependent start: only the elastic sync makes a worker (a new one included) match rank 0.
    model.set_weights(common.initial_weights(0 if hvd.rank() == 0 else 100 + os.getpid() % 1000))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                  distribute=kerasdist.horovod(batch_size_per_worker=True))  # global batch grows with the workers
    state = plugin.KerasElasticState(model)
    log(event="start", weights=flat(model.get_weights()))

    class Plan(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            log(event="train_begin", epoch=state.epoch, weights=flat(model.get_weights()),
                optimizer=flat([v.numpy() for v in model.optimizer.variables]))

        def on_epoch_end(self, epoch, logs=None):
            log(event="epoch_end", epoch=epoch + 1, loss=logs["loss"], weights=flat(model.get_weights()),
                steps=self.params.get("steps"))
            action = actions.get(epoch + 1) if hvd.rank() == 0 else None
            if action and action.startswith("hosts="):
                with open(hosts_file + ".tmp", "w") as f:
                    f.write(HOSTS[action.split("=")[1]])
                os.replace(hosts_file + ".tmp", hosts_file)
                del actions[epoch + 1]
                deadline = time.monotonic() + 20  # Horovod polls discovery every second
                while state._host_messages.empty() and time.monotonic() < deadline:
                    time.sleep(0.1)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch + 1

        def on_train_batch_end(self, batch, logs=None):
            if batch == 1 and hvd.rank() == 0 and actions.get(self.epoch) == "kill":
                del actions[self.epoch]
                log(event="kill", epoch=self.epoch, weights=flat(model.get_weights()))
                with open(os.path.join(outdir, "rank1.pid")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)

    if hvd.rank() == 1:
        with open(os.path.join(outdir, "rank1.pid"), "w") as f:
            f.write(str(os.getpid()))
    x, y = common.data(batches=8)
    plugin.run_elastic(model, x, y, batch_size=common.BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                       callbacks=[Plan()], state=state)
    log(event="done", epoch=state.epoch, weights=flat(model.get_weights()))


def flat(arrays):
    return [float(v) for v in np.concatenate([np.ravel(a) for a in arrays])]


if __name__ == "__main__":
    main(*sys.argv[1:4])
