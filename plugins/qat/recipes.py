"""The two recipes users choose: ``kerasdist.quantize()`` (LiteRT's int8 scheme) and ``kerasdist.tensorrt()``
(TensorRT's explicit quantization, optionally with 2:4 sparsity, which it asks of the prune plugin
through the plan: :meth:`TensorRT.required_optimizations`)."""

import dataclasses
from typing import Optional, Sequence

import kerasdist
from kerasdist.plugin_tools import check_choice, check_number

from .quantizers import EMA_DECAY

WEIGHT_GRANULARITIES = ("per_channel", "per_tensor")
SUPPORTED_BITS = (8,)
#: What ``tensorrt(sparsity="2:4")`` asks the plan for: 2:4 structured pruning from the first step.
SPARSITY_2_4 = ("prune", {"target_sparsity": 0.5, "pattern": "2:4", "schedule": "constant"})


def _check_common(spec, where):
    check_number(spec.ema_decay, "ema_decay", where, minimum=0.0, maximum=1.0)
    if spec.ema_decay in (0.0, 1.0):
        raise kerasdist.KerasdistError(f"{where}: ema_decay={spec.ema_decay!r} is not valid; give a value strictly "
                                       "between 0 and 1 (TFMOT's default 0.999).")
    if isinstance(spec.layers, str):
        spec.layers = [spec.layers]


@dataclasses.dataclass
class Quantize(kerasdist.OptimizationSpec):
    """Int8 quantization-aware training for LiteRT (and ONNX Q/DQ).

    :param weights: "per_channel" (symmetric scale per output channel, what LiteRT uses) or "per_tensor".
    :param bits: 8 (the int8 runtimes' width; others are refused).
    :param layers: None (every quantizable layer; others stay float, with a warning) or layer names.
    :param ema_decay: decay of the moving-average activation ranges (TFMOT's 0.999).
    """

    weights: str = "per_channel"
    bits: int = 8
    layers: Optional[Sequence[str]] = None
    ema_decay: float = EMA_DECAY

    def __post_init__(self):
        check_choice(self.weights, "weights", "quantize", WEIGHT_GRANULARITIES)
        if self.bits not in SUPPORTED_BITS or isinstance(self.bits, bool):
            raise kerasdist.KerasdistError(
                f"quantize: bits={self.bits!r} is not supported; LiteRT, ONNX and TensorRT run int8, so "
                "quantization-aware training simulates bits=8.")
        _check_common(self, "quantize")

    recipe = "litert"


@dataclasses.dataclass
class TensorRT(kerasdist.OptimizationSpec):
    """TensorRT's int8 QAT recipe; ``sparsity="2:4"`` adds 2:4 structured sparsity.

    :param sparsity: None or "2:4".
    :param layers: as for :class:`Quantize`.
    :param ema_decay: as for :class:`Quantize`.
    """

    sparsity: Optional[str] = None
    layers: Optional[Sequence[str]] = None
    ema_decay: float = EMA_DECAY

    def __post_init__(self):
        check_choice(self.sparsity, "sparsity", "tensorrt", ("2:4",), allow_none=True)
        _check_common(self, "tensorrt")

    recipe = "tensorrt"

    def required_optimizations(self):
        """``sparsity="2:4"``: the prune plugin's 2:4 pattern, every weighted kernel, from the first step."""
        return [SPARSITY_2_4] if self.sparsity else []
