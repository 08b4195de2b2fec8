"""The planner's checks of a run's configuration: the hardware it plans for exists (a row of
the device table, a bench.json to calibrate from, a finished run to refine by), for every run
that predicts its step time and for task=plan."""

from __future__ import annotations

from hpctrain.config.plan import plan_setting_problems, plan_settings
from hpctrain.config.rule import check, errors_of
from hpctrain.config.schema import Config
from hpctrain.config.validate.batch import BATCH
from hpctrain.config.validate.model import SHAPE
from hpctrain.plan.inputs import cluster_spec, plan_cluster


@check("cluster.")
def check_cluster_spec(c: Config) -> list[str]:
    """A run predicts its step time from cluster.accelerator or cluster.calibration (a
    bench.json): a name not in the table or a missing file is refused here, not in the ranks."""
    if c.cluster.accelerator is None and c.cluster.calibration is None:
        return []
    return errors_of(c, cluster_spec)


@check("plan", "cluster.", *BATCH, *SHAPE, "train.")
def check_plan(c: Config) -> list[str]:
    """task=plan: the plan.* settings (keys, ranges, lists) and the cluster's accelerator."""
    errs = plan_setting_problems(c)
    try:
        plan_settings(c)
    except ValueError:  # unknown or mistyped plan.* keys: the accelerator is checked alone
        return errs + errors_of(c, cluster_spec)
    return errs + errors_of(c, plan_cluster)
