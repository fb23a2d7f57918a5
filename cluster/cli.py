"""The ``pdserve`` command line: model set-up, generation, benchmarks, and the cluster."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from cluster.config import ClusterConfig, api_keys, load_config, parse_override


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (default: $PDSERVE_CONFIG)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set scheduler.chunk_size=128 (repeatable)",
    )
    p.add_argument("--model", help="a local Llama-family checkpoint directory (model.path)")


def _config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> ClusterConfig:
    overrides = dict(parse_override(o) for o in args.overrides)
    if getattr(args, "model", None):
        overrides["model.path"] = args.model
    overrides.update(extra or {})
    return load_config(args.config, overrides)


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from cluster.engine.models.default_model import ensure_default_model

    config = _config(args)
    t0 = time.monotonic()
    path = ensure_default_model(config)
    print(f"default model ready at {path} ({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    config = _config(args)
    if not args.offline and _generate_remote(args, config):
        return 0
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    llm = LLM(config=config)
    if args.raw:
        prompt_ids = llm.tokenizer.encode(args.prompt)
    else:
        prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    for out in llm.stream(prompt_ids, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _generate_remote(args: argparse.Namespace, config: ClusterConfig) -> bool:
    """Use a running cluster over gRPC when one answers health checks; False otherwise."""
    import grpc

    from cluster.client import PDServeClient

    host = "127.0.0.1" if config.router.host in ("0.0.0.0", "::") else config.router.host
    client = PDServeClient(
        f"{host}:{config.router.grpc_port}",
        api_key=next(iter(api_keys(config.router)), None),
    )
    try:
        if not client.is_serving(timeout=0.5):
            return False
        sampling: dict[str, Any] = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
        }
        if args.seed is not None:
            sampling["seed"] = args.seed
        if args.raw:
            stream = client.generate(args.prompt, **sampling)
        else:
            stream = client.generate(
                messages=[{"role": "user", "content": args.prompt}], **sampling
            )
        try:
            for msg in stream:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            raise ValueError(f"{e.code().name}: {e.details()}") from None
        sys.stdout.write("\n")
        return True
    finally:
        client.close()


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.serve_main import serve_forever

    extra: dict[str, Any] = {}
    if args.prefill_replicas is not None:
        extra["prefill.num_replicas"] = args.prefill_replicas
    if args.decode_replicas is not None:
        extra["decode.num_replicas"] = args.decode_replicas
    if args.allow_unauthenticated:
        extra["router.allow_unauthenticated"] = True
    return serve_forever(
        _config(args, extra),
        address=args.address,
        metrics_port=args.metrics_port,
        dashboard=args.dashboard,
    )


def cmd_drain(args: argparse.Namespace) -> int:
    from cluster.app import APP_NAME
    from cluster.serve_main import drain_decode_replica

    return drain_decode_replica(
        args.replica, address=args.address, app_name=args.app or APP_NAME, timeout_s=args.timeout
    )


# The benchmarks are a distribution of their own (benchmarks/ in the source tree), not in the
# pdserve wheel: `pdserve bench` loads them when it runs, and says how to install them if absent.
BENCHMARKS_MODULE = "benchmarks"
INSTALL_BENCHMARKS = "pip install -e ./benchmarks"


def load_benchmarks() -> ModuleType:
    """The installed benchmarks package; a ValueError naming the command that installs it when
    there is none (or an unrelated package took its name)."""
    try:
        module = importlib.import_module(BENCHMARKS_MODULE)
    except ModuleNotFoundError as e:
        if e.name != BENCHMARKS_MODULE:
            raise  # the benchmarks are there; something they import is not
        module = None
    if module is None or not hasattr(module, "run_benchmark"):
        raise ValueError(
            "the benchmarks are not installed: they are not part of the pdserve package. "
            f"From a pdserve source checkout, install them with `{INSTALL_BENCHMARKS}` "
            "(`make setup` does this)"
        )
    return module


def cmd_bench(args: argparse.Namespace) -> int:
    benchmarks = load_benchmarks()
    rc: int = benchmarks.run_benchmark(args.name, _mode(args), _config(args))
    return rc


def _mode(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def _int_list(text: str, flag: str) -> list[int]:
    """``1,2`` -> [1, 2]: counts >= 1, or ValueError naming the flag."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected a list like 1,2, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag}: every count must be >= 1")
    return values


def cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cluster.planner.measure.profiler import run_profile

    threads = _int_list(args.threads, "--threads") if args.threads else None
    tps = _int_list(args.tp, "--tp") if args.tp else [1]
    run_profile(
        _config(args),
        _mode(args),
        Path(args.out),
        threads,
        serving=not args.no_serving,
        tp_sizes=tps,
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.validate:
        from cluster.planner.measure.validate import run_check

        return run_check(
            _config(args),
            _mode(args),
            Path(args.profile) if args.profile else None,
            Path(args.out),
        )
    from cluster.planner.cli import run_plan

    return run_plan(
        profile=Path(args.profile) if args.profile else None,
        workload=args.workload,
        rate=args.rate,
        devices=args.devices,
        quick=args.quick or args.smoke,
        out=Path(args.out),
        kv_blocks_per_device=args.kv_blocks_per_device,
    )


def _add_model(sub: Any) -> None:
    model = sub.add_parser("model", help="manage the default model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser("fetch", help="convert the default model once and cache it")
    _add_config_args(fetch)
    fetch.set_defaults(func=cmd_model_fetch)


def _add_generate(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate a reply to a prompt (streams to stdout)")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--offline",
        action="store_true",
        help="run the engine in this process even if a cluster is up",
    )
    _add_config_args(gen)
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub: Any) -> None:
    srv = sub.add_parser("serve", help="start (or join) Ray and serve the cluster")
    srv.add_argument("--prefill-replicas", type=int, default=None)
    srv.add_argument("--decode-replicas", type=int, default=None)
    srv.add_argument(
        "--address",
        default=None,
        help="an existing Ray cluster (e.g. auto, ray://host:10001); default: local",
    )
    srv.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="Prometheus metrics of this node (local Ray only)",
    )
    srv.add_argument("--dashboard", action="store_true", help="Ray dashboard on 127.0.0.1:8265")
    srv.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback router.host without API keys (prints a warning)",
    )
    _add_config_args(srv)
    srv.set_defaults(func=cmd_serve)


def _add_drain(sub: Any) -> None:
    drain = sub.add_parser(
        "drain",
        help="move a decode replica's running requests to the others (live migration)",
    )
    drain.add_argument("--replica", default=None, help="the decode replica id; none: list them")
    drain.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    drain.add_argument("--app", default=None, help="the Serve application (default: pdserve)")
    drain.add_argument("--timeout", type=float, default=60.0, help="seconds to reach it")
    drain.set_defaults(func=cmd_drain)


def _add_bench(sub: Any) -> None:
    bench = sub.add_parser("bench", help="run a benchmark (see docs/benchmarks/index.md)")
    bench.add_argument("name", help="benchmark name, or 'all'")
    mode = bench.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer requests, same ratios")
    mode.add_argument("--smoke", action="store_true", help="tiny random model: harness check")
    _add_config_args(bench)
    bench.set_defaults(func=cmd_bench)


def _add_profile(sub: Any) -> None:
    prof = sub.add_parser("profile", help="measure this machine's step costs for pdserve plan")
    prof.add_argument("--out", default="bench/results/profile.json", help="the profile file")
    prof.add_argument("--threads", help="torch thread counts to profile, e.g. 1,2 (CPU)")
    prof.add_argument(
        "--tp",
        help="tensor-parallel sizes to profile too, e.g. 1,2 (CPU: each size with the thread "
        "counts whose ranks x threads fit the cores; default 1)",
    )
    prof.add_argument("--no-serving", action="store_true", help="skip the local-cluster part")
    pmode = prof.add_mutually_exclusive_group()
    pmode.add_argument("--quick", action="store_true", help="a coarser grid")
    pmode.add_argument("--smoke", action="store_true", help="tiny random model: harness check")
    _add_config_args(prof)
    prof.set_defaults(func=cmd_profile)


def _add_plan(sub: Any) -> None:
    plan = sub.add_parser("plan", help="the best prefill/decode split by simulation")
    plan.add_argument("--profile", help="a profile file (default: the shipped example)")
    plan.add_argument("--workload", default="mixed-long", help="a workload name or JSON file")
    plan.add_argument("--rate", type=float, default=0.5, help="requests/s to evaluate at")
    plan.add_argument("--devices", type=int, default=2, help="devices (CPU: cores) to split")
    plan.add_argument("--kv-blocks-per-device", type=int, default=700)
    plan.add_argument("--out", default="bench/results", help="where the JSON and PNG go")
    plan.add_argument(
        "--validate",
        action="store_true",
        help="predict, then measure bench serve's arms on a local cluster, and compare",
    )
    lmode = plan.add_mutually_exclusive_group()
    lmode.add_argument("--quick", action="store_true", help="fewer simulated requests")
    lmode.add_argument("--smoke", action="store_true", help="the smallest run (tests)")
    _add_config_args(plan)
    plan.set_defaults(func=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray Serve."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    adders = (
        _add_model,
        _add_generate,
        _add_serve,
        _add_drain,
        _add_bench,
        _add_profile,
        _add_plan,
    )
    for add in adders:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        rc: int = args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
