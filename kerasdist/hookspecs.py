"""The hook specifications: the single contract between kerasdist and its plugins.

Every plugin, built-in or third-party, is a module (or object) with functions
marked ``@kerasdist.hookimpl`` whose names match the specs below. A hook
implementation may accept any subset of the spec's arguments.

Lifecycle of ``model.compile(..., distribute=X)``::

    registration  kerasdist_register_strategies / _optimizations / _exporters
    import        kerasdist_detect_cluster -> kerasdist_process_start (clusters only)
    resolution    kerasdist_detect_cluster -> kerasdist_auto_strategy ("auto" only)
    compile       kerasdist_create_strategy -> (model moved under the strategy)
                  -> kerasdist_prepare_model -> kerasdist_adjust_compile
    fit/evaluate/predict
                  kerasdist_prepare_dataset -> kerasdist_adjust_call -> kerasdist_run_call
    export        kerasdist.export(model, path, format) -> the registered exporter
    launch        kerasdist_add_launch_arguments -> kerasdist_launch_environment (per worker)

Hooks that take a ``spec`` are called once per spec in the plan (the strategy
spec first, then each optimization spec, in the order given); an
implementation returns ``None``/does nothing for specs that are not its own.
"""

import typing

import pluggy

PROJECT = "kerasdist"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@typing.runtime_checkable
class StrategyLike(typing.Protocol):
    """What kerasdist's core needs from a strategy that is not a ``tf.distribute.Strategy``
    (``kerasdist_create_strategy`` on JAX, PyTorch, ...): ``scope()`` only.

    ``scope()`` returns a context manager. The core enters it while it makes compile's optimizer,
    while ``kerasdist_prepare_model``, ``kerasdist_adjust_compile`` and Keras's ``compile`` run, while
    ``kerasdist_prepare_dataset`` and ``kerasdist_adjust_call`` run, and while ``load_model`` rebuilds a
    model saved with ``distribute=``. It does not enter it around Keras's own ``fit``/``evaluate``/
    ``predict``: a plugin that needs it there enters it in ``kerasdist_run_call``.

    Optional: ``num_replicas_in_sync``, how many replicas train in sync (plugins read it with
    ``getattr(strategy, "num_replicas_in_sync", 1)``; ``keras.distribution.Distribution`` has none).
    The core touches nothing else: such a strategy's plugin places the model's variables itself
    (``kerasdist_prepare_model``); devices, collective keys and the Keras-version checks of
    tf.distribute strategies do not apply.
    """

    def scope(self):
        """A context manager under which the model is compiled and calls are prepared."""


# -- registration -------------------------------------------------------------

@hookspec
def kerasdist_register_strategies(register):
    """Register strategy plugins.

    :param register: ``register(name, spec_class, *, description, aliases=(),
        requires=(), extra=None, install=None, backends=("tensorflow",), check=None,
        override=False, **defaults)``. ``spec_class`` subclasses
        :class:`kerasdist.StrategySpec`; ``requires`` lists importable module names
        checked without importing them; ``extra`` names the pip extra that installs
        them; ``check()`` returns a reason string when the plugin cannot run here.
    """


@hookspec
def kerasdist_register_optimizations(register):
    """Register optimization plugins (pruning, quantization, ...).

    :param register: as for :func:`kerasdist_register_strategies`, with
        ``spec_class`` a subclass of :class:`kerasdist.OptimizationSpec`.
    """


@hookspec
def kerasdist_register_exporters(register):
    """Register post-training export formats used by :func:`kerasdist.export`.

    :param register: ``register(format, export_function, *, description, aliases=(),
        requires=(), extra=None, install=None, backends=("tensorflow",), check=None,
        override=False, **defaults)``; ``export_function(model, filepath, **options)``
        writes the file and returns a result object or path.
    """


# -- resolution ---------------------------------------------------------------

@hookspec(firstresult=True)
def kerasdist_detect_cluster(environ):
    """Describe the cluster this process belongs to, or return None.

    Stops at the first non-None result.

    :param environ: the process environment (a mapping).
    :return: a :class:`kerasdist.ClusterInfo` or None.
    """


@hookspec(firstresult=True)
def kerasdist_auto_strategy(cluster):
    """Name the strategy ``distribute="auto"`` should use, or None to pass.

    Stops at the first non-None result.

    :param cluster: the :class:`kerasdist.ClusterInfo` detected (never None; a
        single local process is ``ClusterInfo.local()``).
    """


# -- compile ------------------------------------------------------------------

@hookspec(firstresult=True)
def kerasdist_create_strategy(spec, cluster):
    """Create the strategy for ``spec``; None if ``spec`` is not yours.

    Return a ``tf.distribute.Strategy`` (TensorFlow backend: the core moves the model and its optimizer
    under it), or any object that meets :class:`kerasdist.StrategyLike`: a ``scope()`` context manager
    and nothing else (a ``keras.distribution.Distribution`` on JAX; a plugin's own object on PyTorch).
    An object without a callable ``scope`` is refused at compile with a
    :class:`kerasdist.PluginValidationError` naming the spec.

    Stops at the first non-None result. Called once per distinct spec per process:
    the strategy is reused by every later ``compile`` with an equal spec (until
    ``kerasdist.process_state.reset()``).

    :param spec: the :class:`kerasdist.StrategySpec` being resolved.
    :param cluster: the detected :class:`kerasdist.ClusterInfo`.
    """


@hookspec
def kerasdist_prepare_model(model, strategy, spec):
    """Act on the model once it lives under ``strategy``, before compile.

    Called for every spec of the plan. Use it to broadcast initial state,
    wrap layers, or record per-model state.
    """


@hookspec
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    """Change the arguments of the real ``compile`` in place (e.g. wrap the optimizer).

    :param compile_kwargs: dict of the ``compile`` arguments, ``optimizer``
        already an optimizer instance.
    """


# -- fit / evaluate / predict -------------------------------------------------

@hookspec(firstresult=True)
def kerasdist_prepare_dataset(dataset, kind, method, model, strategy, spec):
    """Return a replacement for an input that holds whole batches (shard, rebatch), or None.

    Stops at the first non-None result. Called for ``x`` and, in ``fit``, for ``validation_data``
    of these kinds (with ``method="evaluate"``), each named by ``kind``:

    - ``"tf.data"``: a ``tf.data.Dataset``;
    - ``"py_dataset"``: a ``keras.utils.PyDataset``;
    - ``"generator"``: a Python generator (a replacement cannot look at its batches without
      consuming them: wrap it);
    - ``"torch_dataloader"``: a ``torch.utils.data.DataLoader``.

    Not called for in-memory data (NumPy arrays, backend tensors, and lists, tuples and dicts of
    them; a ``validation_data`` tuple): there ``x`` holds only the features and ``y`` and
    ``sample_weight`` are other arguments, so change them together in ``kerasdist_adjust_call``
    (``kerasdist.plugin_tools.arrays_as_dataset`` turns them into one ``tf.data.Dataset``).
    An implementation returns None for kinds it does not handle.

    :param kind: one of the kinds above.
    :param method: "fit", "evaluate" or "predict".
    """


@hookspec
def kerasdist_adjust_call(method, call_kwargs, model, strategy, spec):
    """Change the arguments of ``fit``/``evaluate``/``predict`` in place.

    Typical uses: add callbacks, silence output on non-chief workers, redirect
    checkpoint paths. ``call_kwargs["callbacks"]`` is always a list.
    """


@hookspec(firstresult=True)
def kerasdist_run_call(method, call, call_kwargs, model, strategy, spec):
    """Run ``fit``/``evaluate``/``predict`` yourself and return its result, or None.

    Stops at the first non-None result. ``call(**call_kwargs)`` runs Keras's own
    method. For strategies that Keras's loop cannot drive (parameter server).
    """


@hookspec
def kerasdist_job_identity(identity):
    """Change, in place, the identity of this job's ``fit`` backups (a backup is resumed only by the job that
    wrote it; see ``kerasdist.plugin_tools.private_backups``).

    ``identity`` is a dict: ``script``, ``script_sha256``, ``arguments`` (``sys.argv[1:]``), ``replicas``,
    ``model_sha256``, ``optimizer``. An engine that restarts failed workers with other command lines (Ray
    Train: each attempt's worker processes carry new worker ids) replaces ``arguments`` with what stays the same
    across its retries and is equal on every worker (never the worker's rank: every worker reads the chief's
    backup).
    """


# -- process start -------------------------------------------------------------

@hookspec
def kerasdist_process_start(cluster, environ):
    """Called once, at ``import kerasdist``, when a cluster was detected
    (``kerasdist_detect_cluster`` returned a non-local :class:`kerasdist.ClusterInfo`),
    before the user's code runs any TensorFlow op.

    Set up what must exist at program start, e.g. collective ops for
    multi-worker training. Keep it cheap: it runs in every worker process.
    """


# -- Keras objects --------------------------------------------------------------

@hookspec(historic=True)
def kerasdist_keras_imported(keras):
    """Called once per plugin when Keras is imported (or at ``import kerasdist`` if it already was).

    Historic: a plugin registered after Keras was imported (``kerasdist.register_plugin``, a plugin
    system built anew) is called when it registers.

    Register what must exist before a saved model is loaded, e.g. the layer classes a plugin's
    models serialize (``keras.saving.register_keras_serializable``), so that
    ``keras.saving.load_model`` finds them in a process that imported kerasdist.
    """


# -- what listens ---------------------------------------------------------------

@hookspec
def kerasdist_listeners(cluster):
    """Say what this process will listen on in ``cluster`` if your plugin trains there (``kerasdist env``).

    :param cluster: the detected :class:`kerasdist.ClusterInfo`.
    :return: a list of dicts ``{"what": ..., "address": "host:port" or a description,
        "interfaces": "all" or "the address's"}``, or None.
    """


# -- kerasdist launch ----------------------------------------------------------

@hookspec
def kerasdist_add_launch_arguments(parser):
    """Add options to ``kerasdist launch`` (as pytest's ``pytest_addoption``).

    :param parser: an ``argparse`` argument group; call ``parser.add_argument(...)``
        with ``default=None`` so that an option left out sets nothing.
    """


@hookspec
def kerasdist_launch_environment(args, worker, environ):
    """Set what one worker started by ``kerasdist launch`` needs in its environment.

    Called once per worker, after the launcher removed every cluster hint variable
    (``kerasdist.cluster_hints`` entry points) from the caller's environment.

    :param args: the parsed ``kerasdist launch`` arguments (yours included).
    :param worker: a :class:`kerasdist.LaunchWorker`: ``index``, ``count``, ``host``
        and ``addresses`` (one free ``host:port`` per worker, the same list for all).
    :param environ: the worker's environment, a dict to change in place.
    """
