"""Results written for submitit tasks that cannot write their own.

Hydra's submitit launcher waits for the result file of every task it submitted. Two cases
leave some without one: an elastic job that ran fewer tasks than submitted (task 0 writes its
result for the others), and a job that a fault ends without a requeue (the rank that ends it
writes the reason as every task's error, since the others are killed: without Slurm
accounting, submitit would otherwise wait forever). Outside submitit this does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal


def write(outcome: Literal["success", "error"], value: Any, task_ids: Iterable[int]) -> None:
    """submitit's `(outcome, value)` result pickle for each of `task_ids` of this job."""
    folder = os.environ.get("SUBMITIT_FOLDER")
    if folder is None:
        return
    import submitit
    from submitit.core import utils

    job_id = submitit.JobEnvironment().job_id
    for task_id in task_ids:
        path = utils.JobPaths(folder, job_id=job_id, task_id=task_id).result_pickle
        with utils.temporary_save_path(path) as tmp:
            utils.cloudpickle_dump((outcome, value), tmp)
