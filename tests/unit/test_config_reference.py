"""The configuration reference comes from the config dataclasses: every key has a description
(the attribute docstring under its field), and every key with listed choices is validated
against them, so the generated page (docs/configuration/reference.md) cannot drift."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.config import ClusterConfig, config_from_dict
from cluster.config.reference import ConfigKey, config_keys, field_docs, undocumented_keys


def keys() -> list[ConfigKey]:
    return list(config_keys())


def test_every_config_key_has_a_description() -> None:
    missing = undocumented_keys(ClusterConfig)
    assert not missing, (
        "config keys without a description (write a docstring on the line under the field): "
        + ", ".join(missing)
    )


@dataclass(frozen=True)
class _Inner:
    documented: int = 1
    """Says what it is."""
    bare: str = ""  # a comment is not a description


@dataclass(frozen=True)
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    """A section."""
    also_bare: float = 0.5


def test_a_key_without_a_description_is_named() -> None:
    assert undocumented_keys(_Outer) == ["inner.bare", "also_bare"]


def test_inherited_fields_keep_their_descriptions() -> None:
    docs = field_docs(type(ClusterConfig().decode))  # DecodePoolConfig(PoolConfig)
    assert docs["num_replicas"].startswith("Replicas of the pool")
    assert docs["local_prefill_threshold"]


def test_the_reference_walks_the_whole_tree() -> None:
    paths = {k.path for k in keys()}
    for path in (
        "model.weights",
        "prefill.routing.policy",
        "decode.autoscaling.tpot_slo_ms",
        "decode.speculative.method",
        "testing.fake_model.vocab_size",
        "prefill.scheduler",
    ):
        assert path in paths
    assert "prefill.local_prefill_threshold" not in paths  # decode only
    by_path = {k.path: k for k in keys()}
    assert by_path["transfer.transports"].default == "[shm, zmq]"
    assert by_path["transfer.transports"].value_type == "list of string"
    assert by_path["model.max_model_len"].value_type == "int | null"
    assert by_path["router.resources"].default == "{}"
    assert by_path["prefill.scheduler"].section is None  # optional: not expanded


def _with_value(path: str, value: Any) -> dict[str, Any]:
    data: dict[str, Any] = {}
    node = data
    *sections, leaf = path.split(".")
    for name in sections:
        node = node.setdefault(name, {})
    node[leaf] = [value] if path == "transfer.transports" else value
    return data


@pytest.mark.parametrize("key", [k for k in config_keys() if k.choices], ids=lambda k: k.path)
def test_listed_choices_are_the_validated_ones(key: ConfigKey) -> None:
    assert key.default.strip("[]").split(", ")[0] in key.choices  # the default is valid
    with pytest.raises(ValueError, match=rf"^{key.path}: unknown value 'bogus'; valid values"):
        config_from_dict(_with_value(key.path, "bogus"))
    for choice in key.choices:
        config_from_dict(_with_value(key.path, choice))


def test_choices_name_real_fields() -> None:
    for key in keys():
        if key.section is None:
            continue
        choices = getattr(key.section, "CHOICES", {})
        fields = {
            k.path.rpartition(".")[2] for k in keys() if k.path.rpartition(".")[0] == key.path
        }
        assert set(choices) <= fields, (key.path, set(choices) - fields)
