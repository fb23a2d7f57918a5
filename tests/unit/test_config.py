from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import (
    _TRANSPORTS,
    ClusterConfig,
    config_from_dict,
    flat_key_index,
    load_config,
    parse_override,
)


def test_defaults_are_valid_and_frozen() -> None:
    cfg = load_config()
    assert cfg.cache.block_size == 16
    with pytest.raises(AttributeError):
        cfg.cache.block_size = 32  # type: ignore[misc]


def test_unknown_keys_are_rejected_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"cache\.blocksize: unknown config key.*block_size"):
        config_from_dict({"cache": {"blocksize": 16}})
    with pytest.raises(ValueError, match=r"caches: unknown config key.*cache"):
        config_from_dict({"caches": {}})
    with pytest.raises(ValueError, match=r"cache\.nope: unknown config key"):
        load_config(overrides={"cache.nope": 1})


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"cache": {"block_size": 12}}, "cache.block_size"),
        ({"cache": {"block_size": "16"}}, "cache.block_size"),
        ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs"),
        ({"scheduler": {"chunk_size": 0}}, "scheduler.chunk_size"),
        ({"model": {"runner": "tpu"}}, "model.runner"),
        ({"model": {"dtype": "int8"}}, "model.dtype"),
        ({"transfer": {"transports": ["carrier-pigeon"]}}, "transfer.transports"),
        ({"transfer": {"heartbeat_s": 50.0}}, "transfer.heartbeat_s"),
        ({"cache": {"enable_prefix_caching": "yes"}}, "cache.enable_prefix_caching"),
        ({"cache": 5}, "cache"),
        (
            {
                "scheduler": {"chunk_size": None, "max_num_batched_tokens": 512},
                "model": {"max_model_len": 1024},
            },
            "scheduler.max_num_batched_tokens",
        ),
    ],
)
def test_invalid_values_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        config_from_dict(data)


def test_yaml_file_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  block_size: 32\nscheduler:\n  chunk_size: 64\n")
    cfg = load_config(f, overrides={"scheduler.chunk_size": 128})
    assert cfg.cache.block_size == 32 and cfg.scheduler.chunk_size == 128
    assert cfg.replace({"cache.block_size": 8}).cache.block_size == 8
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    assert parse_override("scheduler.chunk_size=null") == ("scheduler.chunk_size", None)
    with pytest.raises(ValueError, match="expected section.key=value"):
        parse_override("oops")


def test_config_round_trips_through_a_plain_dict() -> None:
    cfg = load_config(overrides={"transfer.transports": ["zmq"], "scheduler.chunk_size": None})
    again = config_from_dict(cfg.to_dict())
    assert again == cfg and isinstance(again.transfer.transports, tuple)


def test_secrets_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_TRANSFER_SECRET", "s3cret")
    assert load_config().transfer.hmac_secret == "s3cret"
    assert load_config(overrides={"transfer.hmac_secret": "file"}).transfer.hmac_secret == "file"


def test_flat_keys_and_registries_agree() -> None:
    from cluster.engine.model_runner import RUNNER_REGISTRY

    index = flat_key_index()
    assert index["block_size"] == "cache.block_size"
    assert index["chunk_size"] == "scheduler.chunk_size"
    assert set(RUNNER_REGISTRY) == {"torch", "fake"}
    assert ClusterConfig().model.runner in RUNNER_REGISTRY
    assert "zmq" in _TRANSPORTS


def test_portable_dict_leaves_environment_values_to_each_replica(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from cluster.config import config_from_dict, load_config, portable_dict

    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "10.0.0.7")
    monkeypatch.setenv("PDSERVE_API_KEYS", "key-from-env-123")
    monkeypatch.setenv("PDSERVE_TRANSFER_SECRET", "s" * 32)
    cfg = load_config()
    assert cfg.transfer.advertise_host == "10.0.0.7"
    assert cfg.router.api_keys == ("key-from-env-123",)
    d = portable_dict(cfg)
    assert d["transfer"]["advertise_host"] is None
    assert d["router"]["api_keys"] == [] and d["transfer"]["hmac_secret"] == ""
    assert "key-from-env-123" not in repr(d) and "s" * 32 not in repr(d)
    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "10.0.0.8")  # another pod
    replica = config_from_dict(d)
    assert replica.transfer.advertise_host == "10.0.0.8"
    assert replica.router.api_keys == ("key-from-env-123",)
    # values written in the config itself do travel
    explicit = load_config(overrides={"transfer.advertise_host": "10.9.9.9"})
    assert portable_dict(explicit)["transfer"]["advertise_host"] == "10.9.9.9"
