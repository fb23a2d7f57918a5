from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.config import (
    _TRANSPORTS,
    ClusterConfig,
    advertise_host,
    api_keys,
    config_from_dict,
    curve_keys,
    flat_key_index,
    load_config,
    parse_override,
    transfer_hmac_secret,
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
        ({"router": {"pool_call_transport": "http"}}, "router.pool_call_transport"),
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


def test_secrets_come_from_the_environment_at_the_point_of_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_TRANSFER_SECRET", "s3cret-from-env-0123")
    monkeypatch.setenv("PDSERVE_CURVE_SECRET_KEY", "S" * 40)
    monkeypatch.setenv("PDSERVE_CURVE_PUBLIC_KEY", "P" * 40)
    monkeypatch.setenv("PDSERVE_API_KEYS", " key-from-env-123, ,key-from-env-456")
    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "10.0.0.7")
    cfg = load_config()
    # Nothing from the environment is written into the tree (nor into what replicas receive).
    assert cfg == config_from_dict({})
    assert cfg.transfer.hmac_secret == "" and cfg.router.api_keys == ()
    assert cfg.transfer.advertise_host is None
    plain = repr(cfg.to_dict())
    assert "s3cret" not in plain and "key-from-env" not in plain and "10.0.0.7" not in plain
    # Read where used: the environment's value when the config has none.
    assert transfer_hmac_secret(cfg.transfer) == "s3cret-from-env-0123"
    assert curve_keys(cfg.transfer) == ("S" * 40, "P" * 40)
    assert api_keys(cfg.router) == ("key-from-env-123", "key-from-env-456")
    assert advertise_host(cfg.transfer) == "10.0.0.7"
    # The config's own value wins.
    own = load_config(
        overrides={
            "transfer.hmac_secret": "file",
            "transfer.curve_public_key": "p" * 40,
            "transfer.advertise_host": "10.9.9.9",
            "router.api_keys": ["key-in-config-1"],
        }
    )
    assert transfer_hmac_secret(own.transfer) == "file"
    assert curve_keys(own.transfer) == ("S" * 40, "p" * 40)
    assert advertise_host(own.transfer) == "10.9.9.9"
    assert api_keys(own.router) == ("key-in-config-1",)
    # Neither: bind_host, no secret, no keys.
    for env in ("PDSERVE_ADVERTISE_HOST", "PDSERVE_TRANSFER_SECRET", "PDSERVE_API_KEYS"):
        monkeypatch.delenv(env)
    assert advertise_host(cfg.transfer) == cfg.transfer.bind_host
    assert transfer_hmac_secret(cfg.transfer) == "" and api_keys(cfg.router) == ()


def test_api_keys_from_the_environment_are_checked_at_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDSERVE_API_KEYS", "short")
    cfg = load_config()  # loading never reads the keys
    with pytest.raises(ValueError, match=r"^router\.api_keys: .*PDSERVE_API_KEYS"):
        api_keys(cfg.router)
    monkeypatch.setenv("PDSERVE_API_KEYS", "env-key-12345")
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nfile-key-12345\nenv-key-12345\n")
    with_file = cfg.replace({"router.api_keys_file": str(keys_file)})
    assert api_keys(with_file.router) == ("env-key-12345", "file-key-12345")


def test_fault_points_and_forced_preemption_need_test_mode() -> None:
    with pytest.raises(ValueError, match=r"^testing\.fault_points: .*set testing\.enabled"):
        config_from_dict({"testing": {"fault_points": ["p.x=raise"]}})
    with pytest.raises(
        ValueError, match=r"^testing\.force_preempt_interval: .*set testing\.enabled"
    ):
        load_config(overrides={"testing.force_preempt_interval": 3})
    assert not ClusterConfig().testing.enabled
    on = config_from_dict(
        {"testing": {"enabled": True, "fault_points": ["p.x"], "force_preempt_interval": 3}}
    )
    assert on.testing.fault_points == ("p.x",) and on.testing.force_preempt_interval == 3
    config_from_dict({"testing": {"enabled": False, "fake_model": {"vocab_size": 64}}})
    with pytest.raises(ValueError, match=r"^testing\.fake_model\.load_delay_s: must be >= 0"):
        config_from_dict({"testing": {"fake_model": {"load_delay_s": -1}}})


def test_flat_keys_and_registries_agree() -> None:
    from cluster.engine.runner_registry import RUNNER_REGISTRY

    index = flat_key_index()
    assert index["block_size"] == "cache.block_size"
    assert index["chunk_size"] == "scheduler.chunk_size"
    assert set(RUNNER_REGISTRY) == {"torch", "fake"}
    assert ClusterConfig().model.runner in RUNNER_REGISTRY
    assert "zmq" in _TRANSPORTS


def test_declared_formats_name_the_weights_and_kv_formats() -> None:
    from cluster.config.model import declared_formats

    def formats(**overrides: object) -> dict[str, str]:
        cfg = ClusterConfig().replace(overrides)
        return declared_formats(cfg.model, cfg.cache)

    # auto is exact today (NUMERICS_DEFAULT): nothing to add; were it fast, the banner would say
    # the pools decide by their CPUs
    from cluster.config import model as model_config

    auto = (
        ", numerics auto (fast where the CPU has the AVX-512 integer kernels, else exact)"
        if model_config.NUMERICS_DEFAULT == "fast"
        else ""
    )
    assert formats() == {
        "weights": "gguf (the file's own quantized blocks)" + auto,
        "kv_cache": "model dtype (float32 on CPU)",
    }
    assert formats(**{"model.weights": "int8_rows", "model.numerics": "exact"})["weights"] == (
        "int8 (per output channel)"
    )
    assert formats(**{"model.weights": "int8", "cache.kv_dtype": "int8"}) == {
        "weights": "int8 (groups of 32, fp16 scale and minimum)" + auto,
        "kv_cache": "int8 (one fp32 scale per token and KV head)",
    }
    assert formats(**{"model.weights": "dense", "model.dtype": "bfloat16"}) == {
        "weights": "dense (bfloat16)",
        "kv_cache": "bfloat16",
    }
    assert formats(**{"model.numerics": "fast"})["weights"] == (
        "gguf (the file's own quantized blocks), int8 activations (fast)"
    )
    assert formats(**{"model.weights": "int8", "model.numerics": "fast"})["weights"] == (
        "int8 (groups of 32, fp16 scale and minimum), int8 activations (fast)"
    )


def test_fast_numerics_need_packed_weights_and_the_native_kernels() -> None:
    from cluster.config.model import NUMERICS_DEFAULT

    def model(**overrides: object) -> Any:
        return ClusterConfig().replace(overrides).model

    assert model().numerics == "auto" and model().resolved_numerics == NUMERICS_DEFAULT
    for weights in ("gguf", "int8", "int8_rows"):
        fast = model(**{"model.weights": weights, "model.numerics": "fast"})
        assert fast.resolved_numerics == "fast"
    # auto is exact wherever fast cannot run: dense weights, the torch backend
    assert model(**{"model.weights": "dense"}).resolved_numerics == "exact"
    assert model(**{"model.kernels": "torch"}).resolved_numerics == "exact"
    with pytest.raises(ValueError, match=r"^model\.numerics: fast needs packed weights, not "
                       r"model\.weights: dense"):  # fmt: skip
        model(**{"model.weights": "dense", "model.numerics": "fast"})
    with pytest.raises(ValueError, match=r"model\.weights: auto \(dense for this model\.path"):
        model(**{"model.path": "/models/llama", "model.numerics": "fast"})
    with pytest.raises(ValueError, match=r"^model\.numerics: fast .* not model\.kernels: torch"):
        model(**{"model.kernels": "torch", "model.numerics": "fast"})
    with pytest.raises(ValueError, match="model.numerics: unknown value 'int8'"):
        model(**{"model.numerics": "int8"})


def test_replicas_start_with_the_allocator_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.config.environment import POOL_ALLOCATOR_ENV, ROUTER_ALLOCATOR_ENV
    from cluster.serving.options import deployment_options

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    opts = deployment_options(ClusterConfig())
    envs = {name: o["ray_actor_options"]["runtime_env"]["env_vars"] for name, o in opts.items()}
    assert envs["Router"] == ROUTER_ALLOCATOR_ENV
    # The pools keep glibc's rising mmap threshold: fixed, every prefill activation was a fresh
    # mmap (a 1,024-token prefill 1.6x slower on 1 thread, 3.1x on 2).
    for name in ("PrefillServer", "DecodeServer"):
        assert envs[name] == POOL_ALLOCATOR_ENV, name
        assert "MALLOC_MMAP_THRESHOLD_" not in envs[name], name
    # The launching environment's own setting is passed on, not overridden.
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    env = deployment_options(ClusterConfig())["Router"]["ray_actor_options"]["runtime_env"]
    assert env["env_vars"]["MALLOC_ARENA_MAX"] == "4"


def test_each_deployment_gets_its_shutdown_wait_loop() -> None:
    from cluster.serving.options import deployment_options

    cfg = ClusterConfig().replace(
        {
            "router.graceful_shutdown_wait_loop_s": 0.5,
            "prefill.graceful_shutdown_wait_loop_s": 0.25,
            "decode.graceful_shutdown_wait_loop_s": 1.5,
        }
    )
    opts = deployment_options(cfg)
    assert opts["Router"]["graceful_shutdown_wait_loop_s"] == 0.5
    assert opts["PrefillServer"]["graceful_shutdown_wait_loop_s"] == 0.25
    assert opts["DecodeServer"]["graceful_shutdown_wait_loop_s"] == 1.5
    # Serve's own default unless configured.
    assert deployment_options(ClusterConfig())["Router"]["graceful_shutdown_wait_loop_s"] == 2.0
    for key in ("router", "prefill", "decode"):
        with pytest.raises(ValueError, match=f"{key}.graceful_shutdown_wait_loop_s"):
            ClusterConfig().replace({f"{key}.graceful_shutdown_wait_loop_s": 0})


def test_a_config_built_in_code_caches_where_a_loaded_one_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ClusterConfig()`` (cache_dir "") used to resolve to the working directory, so code that
    built one wrote converted models and kernels next to whatever it ran in."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert ClusterConfig().paths.resolved_cache_dir == tmp_path / "env-cache"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ClusterConfig().paths.resolved_cache_dir == tmp_path / "xdg" / "pdserve"
    named = ClusterConfig().replace({"paths.cache_dir": str(tmp_path / "mine")})
    assert named.paths.resolved_cache_dir == tmp_path / "mine"
