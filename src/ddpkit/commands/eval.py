"""``ddpkit eval RUN_DIR``: re-evaluate RUN_DIR/model.pt with the run's own config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

HELP = "re-evaluate a run's model.pt on its test set, exactly and distributed"


def register(parser) -> None:
    parser.add_argument("run_dir", help="a ddpkit run directory (holds config.toml and model.pt)")
    parser.add_argument("--nproc", default="auto", help="processes: N or auto (default: auto)")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda (default: the run's)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from .flags import prestart_if_workers

    prestart_if_workers(args.nproc)  # before torch is imported below
    from ..data import load_dataset
    from ..run.rundir import check_rebuilt, finished_cli_run, load_trained_model
    from ..train.task import Classification, ModelLoss
    from ..trainer import run_evaluation

    run_dir = Path(args.run_dir)
    cfg = finished_cli_run(
        run_dir,
        f"evaluate it there: model.load_state_dict(torch.load('{run_dir / 'model.pt'}')), "
        f"then Trainer(config, model=model, test_data=..., loss_fn=...).evaluate()",
    )
    # Evaluation runs on this node alone, whatever launched the training.
    cfg = dataclasses.replace(
        cfg,
        nproc=args.nproc,
        run_dir=str(run_dir),
        device=args.device or cfg.device,
        nnodes=1,
        rdzv_endpoint="",
        rdzv_id="",
        local_addr="",
        max_restarts=0,
        replicas=1,
    )
    cfg.validate()
    # Everything that can fail, checked here once, not on every rank: the data, the model and data an
    # import path builds now against what the run recorded, and the weights.
    splits = load_dataset(cfg)
    check_rebuilt(cfg, run_dir, splits)
    load_trained_model(cfg, splits.meta, run_dir)
    # The CLI trains classification, or a model's own loss on dict samples (--dataset pkg.module:function)
    task = (
        ModelLoss() if cfg.task.startswith("model-loss") else Classification(cfg.label_smoothing or 0.0, bool(cfg.tta))
    )
    result = run_evaluation(cfg, task, splits)
    print(json.dumps(result))
    return 0
