"""Plan reports: a JSON-serialisable dict for one layout, and plain-text tables for people."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from hpctrain.plan.bubble import in_flight_microbatches
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.experts import is_moe
from hpctrain.plan.layout import Layout, check_layout, num_microbatches
from hpctrain.plan.search import Candidate, evaluate_layout
from hpctrain.plan.shapes import Shape

GIB = 2**30
_MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "buffers")


def plan_report(
    model: Shape, cluster: ClusterSpec, *, layout: Layout, global_batch: int,
    micro_batch_size: int, seq_len: int, recompute: str = "none", precision: str = "bf16",
    in_flight: int | None = None, dp_overlap: float = 0.0,
    attended_per_token: float | None = None, fp8: bool = False,
    usable_bytes: float | None = None, zero3_reshard: bool = True,
) -> dict:
    """Memory (bytes) and time predictions for one layout, with every input echoed.

    fits: the predicted peak is at most `usable_bytes` (the device memory less plan.headroom,
    the limit parallel=auto and the pre-launch check use); None: the whole device.

    in_flight: activation sets alive at the peak (from the pipeline simulator); None takes the
    closed form `in_flight_microbatches`. attended_per_token: see `plan.time.step_time`.
    All values are plain str/int/float/bool/None. Models with routed experts add "params"
    (total and active per token; MFU counts active FLOPs).
    """
    check_layout(model, layout, global_batch=global_batch, micro_batch_size=micro_batch_size)
    m = num_microbatches(global_batch, micro_batch_size=micro_batch_size, dp=layout.dp)
    if in_flight is None:
        in_flight = in_flight_microbatches(layout.schedule, pp=layout.pp, m=m,
                                           v=layout.virtual_stages)
    scored = evaluate_layout(model, cluster, layout, recompute, global_batch=global_batch,
                             micro_batch_size=micro_batch_size, seq_len=seq_len,
                             precision=precision, dp_overlap=dp_overlap, in_flight=in_flight,
                             attended_per_token=attended_per_token, fp8=fp8,
                             zero3_reshard=zero3_reshard)
    mem, t = scored.memory, scored.time
    usable = float(cluster.device.memory_bytes if usable_bytes is None else usable_bytes)
    memory = {k: getattr(mem, k) for k in _MEMORY_KEYS}
    memory.update(total=mem.total, host=mem.host, staging=mem.staging)
    inputs = {
        "model": asdict(model), "cluster": asdict(cluster), "layout": asdict(layout),
        "global_batch": global_batch, "micro_batch_size": micro_batch_size,
        "num_microbatches": m, "seq_len": seq_len, "recompute": recompute,
        "precision": precision, "in_flight": in_flight, "dp_overlap": dp_overlap,
        "attended_per_token": attended_per_token,
    }
    return {
        "inputs": inputs,
        **_param_counts(model),
        "memory_bytes": memory,
        "device_memory_bytes": cluster.device.memory_bytes,
        "usable_memory_bytes": usable,
        "fits": mem.fits(usable),
        "time": asdict(t),
        "step_time_s": t.step_time_s,
        "tokens_per_s": t.tokens_per_s,
        "tflops_per_device": t.tflops_per_device,
        "mfu": t.mfu,
    }


def _param_counts(model: Shape) -> dict:
    """{"params": {total, active}} for a model with routed experts, {} for a dense one."""
    if not is_moe(model):
        return {}
    return {"params": {"total": model.num_params(), "active": model.num_params(active=True)}}


def format_plan_table(report: dict) -> str:
    """Two-column text table of a `plan_report` dict: memory in GiB, then time and rates."""
    inputs = report["inputs"]
    lay = Layout(**inputs["layout"])
    rows = [("model", str(inputs["model"]["name"])), ("layout", lay.describe()),
            ("recompute", inputs["recompute"]), ("precision", inputs["precision"])]
    moe = "params" in report  # a model with routed experts: counts, ep and its all-to-all
    if moe:
        n = report["params"]
        rows += [("params", f"{n['total'] / 1e9:.2f}B total, {n['active'] / 1e9:.2f}B active"),
                 ("ep", str(lay.ep))]
    mem = report["memory_bytes"]
    rows += [(f"mem {k}", f"{mem[k] / GIB:.2f} GiB") for k in (*_MEMORY_KEYS, "total")]
    if mem["host"]:
        rows.append(("host (offload)", f"{mem['host'] / GIB:.2f} GiB"))
    cap = report["device_memory_bytes"] / GIB
    usable = report.get("usable_memory_bytes", report["device_memory_bytes"]) / GIB
    rows.append(("fits", f"{'yes' if report['fits'] else 'NO'} ({mem['total'] / GIB:.2f} of "
                         f"{usable:.1f} GiB usable; device {cap:.1f} GiB)"))
    t = report["time"]
    keys = ("step_time_s", "compute_s", "comm_tp_s", "comm_pp_s", "bubble_s", "comm_dp_s")
    for key in keys + (("comm_ep_s",) if moe else ()):
        rows.append((key.removesuffix("_s"), f"{t[key]:.4g} s"))
    mfu = "null" if t["mfu"] is None else f"{t['mfu']:.1%}" + (" (active FLOPs)" if moe else "")
    rows += [("tokens/s", f"{t['tokens_per_s']:,.0f}"),
             ("TFLOP/s/device", f"{t['tflops_per_device']:.1f}"), ("MFU", mfu)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_search_table(candidates: Sequence[Candidate], top: int = 5) -> str:
    """The first `top` candidates of `search_layouts` as a fixed-width table."""
    head = ("#", "layout", "recompute", "step s", "tok/s", "TFLOP/s", "MFU", "mem GiB", "reason")
    rows = [head]
    for i, c in enumerate(candidates[:top], 1):
        rows.append((str(i), c.layout.describe(), c.recompute, f"{c.time.step_time_s:.4g}",
                     f"{c.time.tokens_per_s:,.0f}", f"{c.time.tflops_per_device:.1f}",
                     f"{c.time.mfu:.1%}", f"{c.memory.total / GIB:.1f}", c.reason))
    widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    if len(candidates) > top:
        lines.append(f"... {len(candidates) - top} more: every candidate is in plan.json "
                     "(key \"search\"); plan.top=N shows more here")
    return "\n".join(lines)
