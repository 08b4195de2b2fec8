"""A plain sbatch script for a run, without submitit: `slurm/templates/train.sbatch` filled in
from the Config.

    python -m hpctrain.launch.sbatch cluster=slurm_local parallel=dp2 [--out run.sbatch]
    sbatch run.sbatch

The script runs `srun python -m hpctrain <overrides> hydra.run.dir=<run_dir>` (one task per
rank, `cluster.launcher=slurm` makes each task a rank) with a fixed run dir, so a requeued job
resumes from its newest checkpoint. `render_sbatch` is a pure function of its arguments.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from hydra import compose, initialize_config_dir

from hpctrain.config import hydra_schema
from hpctrain.config.schema import Config
from hpctrain.launch import resolvers
from hpctrain.launch.resolvers import setup_lines
from hpctrain.tasks.configure import parse

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "templates" / "train.sbatch"


def _optional(cfg: Config) -> list[str]:
    c = cfg.cluster
    lines = {"partition": c.partition, "account": c.account, "qos": c.qos,
             "constraint": c.constraint, "exclude": c.exclude,
             "gres": f"gpu:{c.gpus_per_node}" if c.gpus_per_node > 0 else None,
             "mem": f"{c.mem_gb}G" if c.mem_gb is not None else None}
    return [f"#SBATCH --{k}={v}" for k, v in lines.items() if v is not None]


def render_sbatch(cfg: Config, overrides: Sequence[str], *, job_name: str = "hpctrain",
                  template: str | None = None) -> str:
    """The job script for `cfg` (cluster.launcher must be slurm); `overrides` are the Hydra
    overrides that composed it, passed on to every rank with the run dir pinned."""
    if cfg.cluster.launcher != "slurm":
        raise ValueError(f"cluster={cfg.cluster.name} has launcher={cfg.cluster.launcher}: "
                         "render an sbatch script for a Slurm cluster (cluster=slurm, ...)")
    c = cfg.cluster
    args = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    args.append(f"hydra.run.dir={cfg.run_dir}")
    values = {
        "JOB_NAME": job_name,
        "NODE_RANGE": f"{c.min_nodes}-{c.nodes}" if c.elastic else c.nodes,
        "PROCS_PER_NODE": c.procs_per_node,
        "WORLD": c.world_size, "CPUS_PER_TASK": c.cpus_per_task, "TIME_MIN": c.time_min,
        "SIGNAL_DELAY_S": c.signal_delay_s, "RUN_DIR": cfg.run_dir,
        "OPTIONAL_SBATCH": "\n".join(_optional(cfg)),
        "SETUP": "\n".join(["mkdir -p " + shlex.quote(cfg.run_dir),
                            *setup_lines(c.setup, c.env)]),
        "OVERRIDES": " ".join(shlex.quote(a) for a in args),
    }
    text = TEMPLATE.read_text() if template is None else template
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    return text.replace("\n\n\n", "\n\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=slurm parallel=dp2")
    ap.add_argument("--out", help="write the script here (default: stdout)")
    ap.add_argument("--run-dir", help="run dir of the job (default: outputs/sbatch/<now>)")
    ap.add_argument("--job-name", default="hpctrain")
    a = ap.parse_args(argv)
    run_dir = Path(a.run_dir or f"outputs/sbatch/{datetime.now():%Y-%m-%d_%H-%M-%S}").absolute()
    conf_dir = Path(__file__).resolve().parents[2] / "conf"
    hydra_schema.register()  # the Hydra entry of this script: schemas and resolvers (idempotent)
    resolvers.register()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        composed = compose(config_name="config", overrides=list(a.overrides))
    try:
        cfg = parse(composed, run_dir=str(run_dir), overrides=list(a.overrides))
        script = render_sbatch(cfg, a.overrides, job_name=a.job_name)
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)  # sbatch needs the --output dir to exist
    if a.out:
        Path(a.out).write_text(script)
        sys.stderr.write(f"wrote {a.out}: sbatch {a.out}\n")
    else:
        sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
