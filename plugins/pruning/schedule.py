"""The pruning schedule: TFMOT's ``PolynomialDecay`` / ``ConstantSparsity`` math, re-implemented."""


def scheduled_sparsity(spec, step, end_step):
    """The schedule's sparsity at ``step`` (TFMOT PolynomialDecay / ConstantSparsity)."""
    if spec.schedule == "constant":
        return spec.target_sparsity
    progress = min(1.0, max(0.0, (step - spec.begin_step) / (end_step - spec.begin_step)))
    return spec.target_sparsity + (spec.initial_sparsity - spec.target_sparsity) * (1.0 - progress) ** spec.power


def last_pruning_step(spec, step, end_step):
    """The latest step <= ``step`` at which the schedule prunes, or None (before ``begin_step``).

    Pruning steps are TFMOT's (``begin_step``, then every ``frequency`` steps while
    ``step <= end_step``) plus ``end_step`` itself, so that the target is reached there.
    """
    if step < spec.begin_step:
        return None
    if end_step is not None and step >= end_step:
        return end_step
    return spec.begin_step + (step - spec.begin_step) // spec.frequency * spec.frequency
