"""The analytical planner: will a layout fit, how fast will it be, and which layout is best.

Arithmetic (no processes; the parameters of hpctrain's own models are read off one block of
each kind and the ends built on the meta device, hpctrain.models.registry.meta_part): devices →
cluster → the memory model
(`memory.model`, one for the search, task=plan, parallel=auto, the pre-launch check and each
run's prediction) and the time model → layout search → reports. See each module's docstring
for its formulas and sources.
"""

from hpctrain.metrics.devices import DEVICES, DeviceSpec, lookup_device, mfu_or_none
from hpctrain.plan.cluster import ClusterSpec, megatron_a100_cluster
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.formulas import MemoryBreakdown, memory_breakdown, model_state_bytes
from hpctrain.plan.memory.model import StepShape, rank_memory
from hpctrain.plan.report import format_plan_table, format_search_table, plan_report
from hpctrain.plan.search import Candidate, search_layouts
from hpctrain.plan.shapes import GPTShape
from hpctrain.plan.time import StepTime, step_time

__all__ = [
    "DEVICES",
    "Candidate",
    "ClusterSpec",
    "DeviceSpec",
    "GPTShape",
    "Layout",
    "MemoryBreakdown",
    "StepShape",
    "StepTime",
    "format_plan_table",
    "format_search_table",
    "lookup_device",
    "megatron_a100_cluster",
    "memory_breakdown",
    "mfu_or_none",
    "model_state_bytes",
    "plan_report",
    "rank_memory",
    "search_layouts",
    "step_time",
]
