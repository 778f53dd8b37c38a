"""``ddpkit bench``: throughput, speedup and scaling efficiency per world size, beside a cost model."""

from __future__ import annotations

from .flags import TOOL_RUN_FIELDS, add_config_flags, config_from_args, prestart_if_workers

HELP = "measure samples/s, speedup and scaling efficiency at several world sizes, with a cost model's prediction"


def _worlds(text: str) -> list[int]:
    import argparse

    try:
        worlds = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(f"expected world sizes like 1,2,4; got {text!r}")
    return worlds


def _number(low: float, strict: bool, kind=float):
    """An argparse type: a finite ``kind`` above ``low`` (or at least ``low`` when not ``strict``)."""
    import argparse
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (strict and value == low):
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what} {'>' if strict else '>='} {low:g}; got {text!r}")
        return value

    return parse


def register(parser) -> None:
    parser.add_argument(
        "--nproc",
        dest="worlds",
        type=_worlds,
        default=[1, 2],
        metavar="N,N,...",
        help="world sizes to run (default: 1,2); 1 is always included",
    )
    parser.add_argument(
        "--steps", type=_number(0, True, int), default=200, help="optimizer steps per run (default: 200)"
    )
    parser.add_argument(
        "--window", type=_number(0, False, int), default=0, help="steps per timing window (default: steps/10)"
    )
    parser.add_argument(
        "--strong", action="store_true", help="keep the global batch (default: weak scaling, --batch-size per rank)"
    )
    parser.add_argument(
        "--out", default="bench", help="directory for bench.json, bench.md, scaling.png (default: bench)"
    )
    parser.add_argument(
        "--predict", type=_worlds, default=[2, 4, 8], metavar="N,N,...", help="world sizes to predict (default: 2,4,8)"
    )
    parser.add_argument(
        "--gpu-step-ms",
        type=_number(0, True),
        default=None,
        help="a measured world-1 step time on the GPU to predict for, when benching on CPU",
    )
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="run nothing: predict --predict GPUs from "
        "--gpu-step-ms (the world-1 step measured on such a GPU at this --batch-size)",
    )
    parser.add_argument(
        "--busbw-gbs",
        type=_number(0, True),
        default=None,
        help="GPU fabric bus bandwidth, GB/s (default: 370, H100 NVLink)",
    )
    parser.add_argument(
        "--latency-us", type=_number(0, False), default=None, help="GPU fabric latency per ring step, us (default: 5)"
    )
    add_config_flags(parser, skip=TOOL_RUN_FIELDS)
    for action in parser._actions:
        if action.dest == "batch_size":
            action.help = "samples PER RANK (weak scaling), or the global batch with --strong (default: the recipe's)"
    parser.set_defaults(run=run)


def run(args) -> int:
    prestart_if_workers(str(max(args.worlds)))  # before torch is imported below
    import dataclasses
    import sys

    from ..errors import ConfigError
    from ..files import check_writable
    from ..tools.bench import bench, predict_only, write_outputs
    from ..tools.costmodel import LINKS

    cfg = config_from_args(args)
    check_writable(args.out, "--out", directory=True)  # before the runs, not after them
    link = LINKS["h100-nvlink"]
    if args.busbw_gbs is not None or args.latency_us is not None:
        link = dataclasses.replace(
            link,
            name="custom GPU fabric",
            busbw=(link.busbw / 1e9 if args.busbw_gbs is None else args.busbw_gbs) * 1e9,
            latency_s=(link.latency_s * 1e6 if args.latency_us is None else args.latency_us) * 1e-6,
        )
    gpu_step_s = args.gpu_step_ms / 1e3 if args.gpu_step_ms is not None else None
    if args.predict_only:
        if gpu_step_s is None:
            raise ConfigError("--predict-only needs --gpu-step-ms: the world-1 step time measured on the GPU")
        rep = predict_only(cfg, gpu_step_s, link, tuple(args.predict), args.strong)
    else:
        rep = bench(
            cfg,
            args.worlds,
            steps=args.steps,
            strong=args.strong,
            window=args.window,
            comm_hook=cfg.comm_hook,
            zero=cfg.zero,
            predict_worlds=tuple(args.predict),
            gpu_step_s=gpu_step_s,
            gpu_link=link,
        )
    for path in write_outputs(rep, args.out):
        print(f"wrote {path}")
    print(open(f"{args.out}/bench.md").read())
    if not rep.get("valid", True):
        print(f"ddpkit: bench: the results are not valid: {'; '.join(rep['invalid'])}", file=sys.stderr)
        return 1
    return 0
