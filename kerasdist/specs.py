"""Plugin specs: the objects ``distribute=`` accepts, and plans that combine them."""

import dataclasses


class PluginSpec:
    """Options of one plugin use. Subclass as a dataclass; hooks read the fields."""

    kind = "plugin"

    @property
    def name(self):
        return getattr(self, "_kerasdist_name", None) or getattr(type(self), "registered_name", None) \
            or type(self).__name__.lower()

    def __add__(self, other):
        return Plan.combine([self, other])

    def __radd__(self, other):
        return Plan.combine([other, self])


class StrategySpec(PluginSpec):
    """Base class of strategy plugin specs (one per plan)."""

    kind = "strategy"

    def identity(self):
        """What makes two specs one strategy: kerasdist creates one strategy per identity and process.
        Override to resolve defaults (``devices=None`` -> the local devices) so that specs that mean
        the same strategy share it; the default is the spec itself (its class and ``repr``)."""
        return self


class OptimizationSpec(PluginSpec):
    """Base class of optimization plugin specs (any number per plan, each plugin at most once)."""

    kind = "optimization"

    def required_optimizations(self):
        """The other optimizations this one needs, as ``(name, options)`` pairs, e.g.
        ``[("prune", {"pattern": "2:4"})]``. The plan adds each right after this spec, made through the
        registry like ``kerasdist.spec(name, **options)``, so a plugin asks for another's work this way
        instead of importing it, and KERASDIST_DISABLE_PLUGINS / KERASDIST_LOAD_PLUGINS hold. A spec of
        that name already in the plan is kept if it is equal, else the plan is refused. Default: none."""
        return ()


@dataclasses.dataclass(eq=False)
class StrategyInstance(StrategySpec):
    """A ``tf.distribute.Strategy`` object passed as is."""

    strategy: object

    @property
    def name(self):
        return type(self.strategy).__name__


@dataclasses.dataclass(frozen=True)
class Plan:
    """At most one strategy spec plus optimization specs (each plugin once), in order."""

    strategy: StrategySpec = None
    optimizations: tuple = ()

    @property
    def specs(self):
        return ((self.strategy,) if self.strategy is not None else ()) + tuple(self.optimizations)

    @classmethod
    def combine(cls, items):
        from .errors import KerasdistError

        strategy, optimizations = None, []
        for item in items:
            parts = item.specs if isinstance(item, Plan) else (item,)
            for part in parts:
                if isinstance(part, StrategySpec):
                    if strategy is not None:
                        raise KerasdistError(
                            f"distribute= names two strategies, {strategy.name!r} and {part.name!r}; "
                            "give at most one strategy plus any number of optimizations.")
                    strategy = part
                elif isinstance(part, OptimizationSpec):
                    twice = next((o for o in optimizations if o.name == part.name), None)
                    if twice is not None:
                        raise KerasdistError(
                            f"distribute= names the optimization {part.name!r} twice, {twice!r} and {part!r}; "
                            f"give it once, with all its options in one spec (kerasdist.{part.name}(...)).")
                    optimizations.append(part)
                else:
                    raise KerasdistError(f"Cannot combine {part!r} into a distribute= plan: "
                                         "expected kerasdist strategy or optimization specs.")
        return cls(strategy, tuple(optimizations))

    def __add__(self, other):
        return Plan.combine([self, other])

    def describe(self):
        return " + ".join(spec.name for spec in self.specs) or "(nothing)"


def spec_key(spec):
    """A hashable identity for a spec's options (strategies are cached per key)."""
    if isinstance(spec, StrategyInstance):
        return ("instance", id(spec.strategy))
    if isinstance(spec, StrategySpec) and type(spec).identity is not StrategySpec.identity:
        return ("identity", repr(spec.identity()))  # plugins may share a strategy: same identity, same one
    return (type(spec).__module__, type(spec).__qualname__, spec.name, repr(spec))
