"""The `sluice` command: simulate, capacity, profile, worker, serve, scheduler.

    sluice simulate --trace sharegpt --policy vllm --policy sarathi --model llama-2-7b \
        --hardware a100-80g --rate 2 --num-requests 1000 --json out.json --plot out.png
    sluice capacity --trace arxiv --policy sarathi --model mistral-7b --hardware a100-80g \
        --slo-profile sarathi-strict --slo-rule sarathi
    sluice profile --model tiny-llama --out profile.json
    sluice worker --model tiny-llama --port 50061
    sluice serve --workers 2 --policy sarathi --demo
    sluice scheduler --worker 127.0.0.1:50061 --worker 127.0.0.1:50062 --port 50051
    sluice gateway --scheduler 127.0.0.1:50051 --port 8000   # the OpenAI HTTP API
    sluice predictor serve --port 50071
    sluice certs --out certs --host sluice.internal     # a dev CA and mTLS certificates
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sluice.common.config import add_config_arguments, config_from


def _workload_args(p: argparse.ArgumentParser) -> None:
    """The flags of simulate and capacity: generated from WorkloadConfig, CostModelConfig and
    SimConfig (each also read from SLUICE_<NAME>), plus the repeatable --policy."""
    from scheduler_service.costmodel.factory import CostModelConfig
    from scheduler_service.sim.simulator import SimConfig
    from scheduler_service.sim.workload_config import WorkloadConfig

    add_config_arguments(p.add_argument_group("workload"), WorkloadConfig)
    s = p.add_argument_group("system")
    s.add_argument("--policy", action="append", help="policy[:key=value,...]; repeat to compare (default vllm)")
    add_config_arguments(s, CostModelConfig)
    add_config_arguments(s, SimConfig, exclude=("policy",))  # the repeatable --policy above
    s.add_argument(
        "--paper-setting",
        action="store_true",
        help="the papers' engine instead of a Sluice deployment's defaults: steps planned one after another, no "
        "waiting bound, no offline queue, 16 GiB of host swap (PAPER_SETTING; a flag given explicitly wins)",
    )
    s.add_argument("--no-progress", action="store_true")


def _setup(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(workload config, cost model, the trace's requests, the length table or None) from the flags."""
    from scheduler_service.costmodel.factory import CostModelConfig
    from scheduler_service.sim.workload_config import WorkloadConfig
    from services.predictor_lengths import is_predictor_source, predictor_lengths

    workload_cfg = config_from(WorkloadConfig, args)
    cost_model = config_from(CostModelConfig, args).build()
    source = args.length_source or "max_tokens"
    if not is_predictor_source(source):
        return workload_cfg, cost_model, workload_cfg.load(), None
    if workload_cfg.tokenizer is None:
        from sluice.common.tokenizer import demo_tokenizer_path

        # NOTE: the predictor counts in its own tokenizer's tokens; a text trace is counted the same way.
        workload_cfg.tokenizer = str(demo_tokenizer_path())
    workload = workload_cfg.load()
    lengths = predictor_lengths(source, workload, seed=workload_cfg.seed, progress=not args.no_progress)
    print(f"length source {source}: {lengths.name}, {len(lengths.predictions)} predictions")
    return workload_cfg, cost_model, workload, lengths


def _sim_config(args: argparse.Namespace, policy: str, seed: int) -> Any:
    from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig

    config = config_from(SimConfig, args, exclude=("policy",), policy=policy, seed=seed, progress=not args.no_progress)
    if getattr(args, "paper_setting", False):
        config = replace(config, **{k: v for k, v in PAPER_SETTING.items() if getattr(args, k, None) is None})
    return config


def cmd_simulate(args: argparse.Namespace) -> int:
    from scheduler_service.sim.report import format_table, plot_runs, write_json
    from scheduler_service.sim.simulator import simulate

    workload_cfg, cost_model, workload, lengths = _setup(args)
    workload = workload_cfg.prepare(workload, cost_model, workload_cfg.rate)
    runs = []
    for policy in args.policy or ["vllm"]:
        run = simulate(_sim_config(args, policy, workload_cfg.seed), workload, cost_model, lengths)
        run.config["rate"] = workload_cfg.rate
        runs.append(run)
    stats = workload.stats()
    print(
        f"{workload.name}: {len(workload)} requests, prompt mean {stats.prompt_mean:.0f}, "
        f"output mean {stats.output_mean:.0f}, {cost_model.model.name} (context {runs[0].config['max_model_len']}) "
        f"on {cost_model.hardware.name} x{_workers_text(runs[0].config)} ({cost_model.name} cost model), "
        f"SLO profile {workload_cfg.slo_profile}"
    )
    print(format_table(runs))
    if any(run.details["rejected_by_reason"] for run in runs):
        print(
            "rejected: prompt_too_long = prompt + 1 token over --max-model-len (the model's context unless set); "
            "exceeds_kv_capacity = the prompt needs more KV than a worker has; unschedulable = no step of the "
            "policy could place it; queue_full = --max-waiting requests were already waiting (--max-waiting none: "
            "no bound)"
        )
    if args.json:
        write_json(runs, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_runs(runs, args.plot, f"{workload.name} on {cost_model.model.name} / {cost_model.hardware.name}")
        print(f"wrote {args.plot}")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    from scheduler_service.core.slo import NO_SLO, tightest_tbt_slo
    from scheduler_service.sim.capacity import find_capacity, parse_rule
    from scheduler_service.sim.simulator import simulate

    rule = parse_rule(args.slo_rule)
    workload_cfg, cost_model, base, lengths = _setup(args)
    results = {}
    for policy in args.policy or ["vllm"]:
        cfg = _sim_config(args, policy, workload_cfg.seed)
        cfg.progress = False
        # the rule's TBT SLO is the one the requests are held to (core/slo.py), as the policies see it
        slos = (r.slo or NO_SLO for r in workload_cfg.prepare(base, cost_model, args.start_rate).requests)
        tbt_slo = tightest_tbt_slo(slos, cfg.tbt_slo_s)

        def run_at(rate: float, cfg: Any = cfg) -> Any:
            run = simulate(cfg, workload_cfg.prepare(base, cost_model, rate), cost_model, lengths)
            run.config["rate"] = rate
            return run

        result = find_capacity(run_at, rule, tbt_slo, start_rate=args.start_rate, rel_tol=args.tolerance)
        results[policy] = {"capacity_req_s": result.capacity_req_s, "probes": result.probes, "tbt_slo_s": tbt_slo}
        print(
            f"{policy}: capacity {result.capacity_req_s:.3f} req/s under {args.slo_rule} (probes: {len(result.probes)})"
        )
    if args.json:
        with open(args.json, "w") as f:
            summary = {"rule": args.slo_rule, "model": cost_model.model.name, "trace": workload_cfg.trace}
            json.dump(
                {**summary, "results": results},
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


def _delegate(module: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).main(args.rest) or 0)

    return run


def _serve_commands(sub: argparse._SubParsersAction) -> None:
    """`serve` (workers as subprocesses + the scheduler), `scheduler` (against running workers)
    and `gateway` (the OpenAI HTTP API in front of a scheduler)."""
    from gateway_service import server as gateway_server
    from services import serve

    p = sub.add_parser("serve", help="start the scheduler and N workers; --demo replays a trace against them")
    serve.add_serve_arguments(p, workers=True)
    p.set_defaults(func=serve.cmd_serve)
    p = sub.add_parser("scheduler", help="run the scheduler service against running workers")
    serve.add_serve_arguments(p, workers=False)
    p.set_defaults(func=serve.cmd_scheduler)
    p = sub.add_parser("gateway", help="serve the OpenAI HTTP API in front of a running scheduler")
    gateway_server.add_arguments(p)
    p.set_defaults(func=gateway_server.cmd_gateway)


def build_parser(*, simulator_only: bool = False) -> argparse.ArgumentParser:
    """Every command; `simulator_only`: `simulate` and `capacity` alone (main's choice when one of
    them is run: the service commands' flags import the servers, a tenth of a simulation's start)."""
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: LLM serving scheduler and simulator")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="replay a trace through policies in the simulator")
    _workload_args(p)
    p.add_argument("--json", help="write metrics JSON here")
    p.add_argument("--plot", help="write a PNG comparison here")
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser("capacity", help="largest sustainable rate under an SLO rule")
    _workload_args(p)
    p.add_argument("--slo-rule", required=True, help="sarathi, attainment:X, p99_tbt:S, p99_ttft:S, norm_latency:S")
    p.add_argument("--start-rate", type=float, default=1.0)
    p.add_argument("--tolerance", type=float, default=0.05, help="relative width at which bisection stops")
    p.add_argument("--json", help="write results JSON here")
    p.set_defaults(func=cmd_capacity)
    if simulator_only:
        return parser
    _serve_commands(sub)
    for name, module, text in (
        ("profile", "services.profile", "measure a worker's step times and write a profile JSON"),
        ("worker", "services.worker", "run one worker service"),
        ("predictor", "services.predictor", "train, export, eval or serve the output-length predictor"),
        ("vllm-serve", "sluice_vllm.launcher", "vllm serve MODEL with a Sluice policy as its scheduler (--policy)"),
    ):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegate(module))
    _client_commands(sub)
    _certs_command(sub)
    return parser


def cmd_certs(args: argparse.Namespace) -> int:
    from sluice.common.certs import DEFAULT_HOSTS, write_dev_pki

    names = args.name or ["scheduler", "worker", "client"]
    written = write_dev_pki(args.out, names, args.host or ())
    print(f"wrote {args.out}/ca.crt and ca.key (a development CA: keep ca.key private)")
    for name, (cert, key) in written.items():
        print(f"  {name}: {cert} {key}")
    print(f"valid for: {', '.join(dict.fromkeys([*(args.host or ()), *DEFAULT_HOSTS]))}")
    first = names[0]
    print(f"serve with: --tls-cert {args.out}/{first}.crt --tls-key {args.out}/{first}.key --tls-ca {args.out}/ca.crt")
    return 0


def _certs_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="make a development CA and TLS certificates for the services and clients")
    p.add_argument("--out", required=True, help="folder to write ca.crt, ca.key, NAME.crt and NAME.key into")
    p.add_argument("--name", action="append", help="a certificate to issue (repeat; default scheduler, worker, client)")
    p.add_argument("--host", action="append", help="a DNS name or IP the certificates are valid for (repeat)")
    p.set_defaults(func=cmd_certs)


def _client_commands(sub: Any) -> None:
    """`sluice generate` and `sluice bench`: clients of a running scheduler (services/generate.py, bench.py)."""
    from services import bench, generate

    generate.add_parser(sub)
    bench.add_parser(sub)


_SIMULATOR_COMMANDS = ("simulate", "capacity")

_DELEGATED = {
    "profile": "services.profile",
    "worker": "services.worker",
    "predictor": "services.predictor",
    "vllm-serve": "sluice_vllm.launcher",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        # NOTE: these commands own their flags; argparse.REMAINDER would reject a leading "--flag".
        import importlib

        return int(importlib.import_module(_DELEGATED[argv[0]]).main(argv[1:]) or 0)
    args = build_parser(simulator_only=bool(argv) and argv[0] in _SIMULATOR_COMMANDS).parse_args(argv)
    try:
        return args.func(args)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _workers_text(config: dict) -> str:
    """`2`, or `1P+3D` for a disaggregated cluster (prefill and decode workers)."""
    if config.get("prefill_workers"):
        return f"{config['prefill_workers']}P+{config['decode_workers']}D (network {config['network']})"
    return str(config["num_workers"])


if __name__ == "__main__":
    sys.exit(main())
