"""Which kernels are pruned: the layers ``Prune(layers=...)`` chooses, and those a pattern/block divides."""

import warnings

import kerasdist
from kerasdist.plugin_tools import all_layers, layers_by_name

from .masks import check_kernel_fits


def _default_types():
    from keras import layers

    return (layers.Dense, layers.EinsumDense, layers.Conv1D, layers.Conv2D, layers.Conv3D,
            layers.Conv1DTranspose, layers.Conv2DTranspose, layers.Conv3DTranspose)


def _has_float_kernel(layer):
    kernel = getattr(layer, "kernel", None)
    return kernel is not None and hasattr(kernel, "assign") and "float" in str(kernel.dtype)


def prunable_layers(model, choice=None):
    """The layers whose kernels ``choice`` (see :class:`Prune` ``layers``) selects in ``model``."""
    candidates = [layer for layer in all_layers(model) if _has_float_kernel(layer)]
    if choice is None:
        chosen = [layer for layer in candidates if isinstance(layer, _default_types())]
        what = "Dense, EinsumDense or Conv layers with a float kernel"
    elif callable(choice):
        chosen = [layer for layer in candidates if choice(layer)]
        what = f"layers with a float kernel accepted by layers={choice!r}"
    else:
        chosen = layers_by_name(model, choice, "prune")
        kernelless = [layer.name for layer in chosen if not _has_float_kernel(layer)]
        if kernelless:
            raise kerasdist.KerasdistError(
                f"prune: layers {kernelless} have no float `kernel` to prune; name Dense/Conv-like layers.")
        what = f"layers named {list(choice)}"
    if not chosen:
        types = sorted({type(layer).__name__ for layer in all_layers(model)}) or ["none"]
        raise kerasdist.KerasdistError(
            f"prune: model {model.name!r} has no prunable layers (looked for {what}; its layer types are "
            f"{', '.join(types)}). Add a Dense or Conv layer, or choose layers with prune(layers=[...]).")
    return chosen


def fitting_structure(layers, spec):
    """The layers whose kernels the pattern/block divides: a layer named in ``layers=`` that does not fit is
    an error; one chosen by default is left dense, with a warning."""
    fitting, skipped = [], []
    for layer in layers:
        try:
            check_kernel_fits(layer, spec.n_of_m, spec.block)
            fitting.append(layer)
        except kerasdist.KerasdistError:
            if spec.layers is not None and not callable(spec.layers):
                raise
            skipped.append(f"{layer.name} {tuple(layer.kernel.shape)}")
    if skipped:
        warnings.warn(f"prune: {'pattern=' + repr(spec.pattern) if spec.pattern else 'block=' + repr(spec.block)} "
                      f"does not divide the kernels of {skipped}; they stay dense.", UserWarning, stacklevel=4)
    if not fitting:
        check_kernel_fits(layers[0], spec.n_of_m, spec.block)  # raises, naming the first layer
    return fitting
