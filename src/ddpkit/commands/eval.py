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
    from ..launcher import LaunchSpec, run_workers
    from ..data import load_dataset
    from ..models import model_for
    from ..rundir import finished_cli_run
    from ..task import Classification
    from ..trainer import Job, check_weights_fit, eval_worker

    run_dir = Path(args.run_dir)
    cfg = finished_cli_run(run_dir, f"evaluate it there: model.load_state_dict(torch.load('{run_dir / 'model.pt'}')), "
                                    f"then Trainer(config, model=model, test_data=..., loss_fn=...).evaluate()")
    # Evaluation runs on this node alone, whatever launched the training.
    cfg = dataclasses.replace(cfg, nproc=args.nproc, run_dir=str(run_dir), device=args.device or cfg.device,
                              nnodes=1, rdzv_endpoint="", rdzv_id="", local_addr="", max_restarts=0)
    cfg.validate()
    # Everything that can fail, checked here once, not on every rank: the data, and the weights.
    splits = load_dataset(cfg)
    check_weights_fit(model_for(cfg, splits.meta), run_dir / "model.pt", "model.pt")
    spec = LaunchSpec.from_config(cfg, resumable=False)
    task = Classification(cfg.label_smoothing or 0.0, bool(cfg.tta))
    job = Job(cfg, task, splits=splits)  # the workers get this data through shared memory
    result = run_workers(eval_worker, (job,), spec)
    print(json.dumps(result))
    return 0
