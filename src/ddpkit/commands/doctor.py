"""``ddpkit doctor``: an environment report for distributed training, and a real all-reduce
(:mod:`ddpkit.tools.doctor`)."""

from __future__ import annotations

from ..config import check_timeout_s
from ..errors import ConfigError

HELP = "report torch/CUDA/NCCL/gloo, GPUs, ports, env vars and CPU load, and run a timed all-reduce; exit 1 on a FAIL"


def register(parser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        metavar="N",
        help="processes for the gloo smoke test and the CPU oversubscription check (default: 2)",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default="",
        metavar="HOST:PORT",
        help="also check this rendezvous endpoint: free here, or reachable elsewhere",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="collective timeout for the smoke test, seconds (default: 60)",
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    from .flags import prestart_if_workers

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    check_timeout_s(args.timeout_s)  # the same bounds as training's (launch() checks them too)
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdecimal() or not 0 < int(port) < 65536:
            raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected HOST:PORT, e.g. node0:29400")
    prestart_if_workers(str(args.nproc))  # before torch is imported below
    import json

    from ..tools.doctor import failed, render, report

    rep = report(args.nproc, args.rdzv_endpoint, args.timeout_s)
    print(json.dumps({"sections": rep, "failed": failed(rep)}, indent=2) if args.json else render(rep))
    return 1 if failed(rep) else 0
