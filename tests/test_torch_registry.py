"""One word, several plugins for disjoint backends (data_parallel: keras_distribution on TensorFlow/JAX,
torch_distributed on torch): lookup picks the running backend's, listings show both, overlaps still fail."""

import dataclasses

import pytest

import kerasdist
from kerasdist import registry as registry_module
from kerasdist.registry import Registry


@dataclasses.dataclass
class TfWord(kerasdist.StrategySpec):
    pass


@dataclasses.dataclass
class TorchWord(kerasdist.StrategySpec):
    pass


@dataclasses.dataclass
class OtherWord(kerasdist.StrategySpec):
    pass


def _registry():
    registry = Registry()
    registry.registrar("strategy", plugin="tf-plugin")("word", TfWord, aliases=("word-alias",),
                                                        backends=("tensorflow", "jax"))
    registry.registrar("strategy", plugin="torch-plugin")("word", TorchWord, aliases=("torchword",),
                                                           backends=("torch",))
    return registry


@pytest.mark.parametrize("backend, expected", [("tensorflow", TfWord), ("jax", TfWord), ("torch", TorchWord)])
def test_lookup_picks_the_running_backends_implementation(monkeypatch, backend, expected):
    monkeypatch.setattr(registry_module, "keras_backend", lambda: backend)
    registry = _registry()
    entry = registry.get("Word")
    assert entry.factory is expected
    spec = entry.create()
    assert isinstance(spec, expected) and registry.entry_of(spec) is entry


def test_each_alias_belongs_to_its_own_implementation(monkeypatch):
    monkeypatch.setattr(registry_module, "keras_backend", lambda: "tensorflow")
    registry = _registry()
    assert registry.get("torchword").factory is TorchWord  # the torch alias never means the TF word
    monkeypatch.setattr(registry_module, "keras_backend", lambda: "torch")
    assert registry.get("word-alias").factory is TfWord


def test_listing_shows_the_word_once_per_implementation_with_its_backends():
    registry = _registry()
    rows = [(r["name"], r["plugin"], tuple(r["backends"])) for r in registry.rows()]
    assert ("word", "tf-plugin", ("tensorflow", "jax")) in rows and ("word", "torch-plugin", ("torch",)) in rows
    assert registry.names() == ["word"]


def test_a_word_on_an_overlapping_backend_is_still_a_duplicate():
    registry = _registry()
    with pytest.raises(kerasdist.DuplicatePluginError, match="'word'"):
        registry.registrar("strategy", plugin="third")("word", OtherWord, backends=("jax", "torch"))
    with pytest.raises(kerasdist.DuplicatePluginError):  # no backends: every backend, so an overlap
        registry.registrar("strategy", plugin="third")("word", OtherWord, backends=())
    with pytest.raises(kerasdist.DuplicatePluginError, match="'torchword'"):  # another word's alias
        registry.registrar("strategy", plugin="third")("torchword2", OtherWord, aliases=("torchword",),
                                                        backends=("jax",))


def test_removing_one_implementation_keeps_the_other(monkeypatch):
    monkeypatch.setattr(registry_module, "keras_backend", lambda: "torch")
    registry = _registry()
    registry.remove_plugin("torch-plugin")
    assert registry.get("word").factory is TfWord
    with pytest.raises(kerasdist.UnknownPluginError):
        registry.get("torchword")


def test_the_installed_data_parallel_is_listed_for_torch_too():
    rows = [r for r in kerasdist.list_plugins() if r["name"] == "data_parallel"]
    backends = {b for r in rows for b in r["backends"]}
    assert {"tensorflow", "jax", "torch"} <= backends
    assert {r["plugin"] for r in rows} == {"keras_distribution", "torch_distributed"}
