"""Checkpoint-write faults injected from outside hpctrain: a test puts this directory on
PYTHONPATH of a `python -m hpctrain` subprocess and sets

  HPCTRAIN_TEST_CKPT_FAULT=<kind>:<step>:<rank>[:<seconds>]

so that rank <rank>'s DCP write of the checkpoint of step <step> (FileSystemWriter.write_data,
which hpctrain calls from its background writer) first sleeps <seconds> (kind `slow`), or dies
by SIGKILL (`kill`), or fails as a full disk would (`enospc`). Nothing in the package knows."""

import os

_SPEC = os.environ.get("HPCTRAIN_TEST_CKPT_FAULT")

if _SPEC:
    import errno
    import signal
    import time

    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    _kind, _step, _rank, *_rest = _SPEC.split(":")
    _original = filesystem.FileSystemWriter.write_data

    def _write_data(self, plan, planner):
        here = f"step_{int(_step):08d}.partial" in str(self.path)
        if here and dist.get_rank() == int(_rank):
            if _kind == "slow":
                time.sleep(float(_rest[0]))
            elif _kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif _kind == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return _original(self, plan, planner)

    filesystem.FileSystemWriter.write_data = _write_data
