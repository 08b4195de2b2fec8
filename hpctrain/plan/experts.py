"""Mixture of experts in the planner: where routed-expert parameters live, what routing
stores, and the all-to-all it sends. Dense shapes (and GPTShape) have no experts: every
function here then returns 0 and the dense formulas of memory.py and time.py stand alone.

Layout (as hpctrain.parallel.moe builds it): routed experts are sharded over ep ranks that
are consecutive dp coordinates (ep divides dp), so one ep group is ep ranks cp·tp apart,
spanning ep·cp·tp consecutive ranks. Experts are whole under tp (never tensor-parallel) and
replicated over the dp/ep ep-groups and over cp. With Ψ_E = n_moe_layers · E · 3·h·f_e:
  expert Ψ per rank  Ψ_E / (pp · ep)   (MoE blocks assumed spread evenly over the stages)
  dense Ψ per rank   everything else: attention, norms, router, shared experts (`rank_params`)
  ZeRO               expert states shard over the (dp/ep)·cp ranks holding the same experts,
                     dense states over dp·cp; gradients reduce over the same groups
Routed activations (the router, each routed slot's row and expert SwiGLU) are counted with
the blocks' other saved tensors in `hpctrain.plan.memory.activations`.
All-to-all (time: `plan.time.ep_comm_s`): 4 per MoE block per micro-batch (dispatch and
combine, forward and backward; 6 when full recomputation runs the forward twice), each sending
per rank
  V = T·k'·h·bytes·(ep−1)/ep
with T the tokens the rank routes (b·s/cp, /t under sp) and k' the expert slots per token
(top_k dropless, capacity_factor·top_k with a capacity), assuming uniform routing (every expert
receives T·k'/E tokens, so a rank keeps 1/ep of its routed copies and sends an equal 1/ep to
each of the ep−1 others). Link: members of an ep group on the same node exchange over NVLink;
with k = min(ep, max(1, g/(cp·tp))) members per node, (k−1)/ep of a rank's routed bytes stay on
the node and (ep−k)/ep leave it through the node's NICs, shared by its g GPUs (all run their
all-to-all at once): time = max(on-node bytes / intra_bw, off-node bytes / (inter_bw/g)) +
(ep−1) message latencies. Not overlapped.
"""

from __future__ import annotations

from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.layout import Layout


def is_moe(model) -> bool:
    """True for a shape with routed experts (a ModelConfig with model.moe enabled)."""
    moe = getattr(model, "moe", None)
    return moe is not None and moe.enabled


def layer_expert_params(model, layer: int) -> int:
    """Routed-expert parameters of block `layer` (0 for dense blocks and shapes)."""
    if not is_moe(model) or not model.is_moe_layer(layer):
        return 0
    return model.moe.num_experts * 3 * model.dim * model.expert_ffn_dim


def expert_params(model) -> int:
    """Ψ_E: routed-expert parameters of the whole model (module docstring)."""
    if not is_moe(model):
        return 0
    return sum(layer_expert_params(model, i) for i in range(model.n_layers))


def rank_expert_params(model, *, ep: int = 1, pp: int = 1) -> float:
    """Routed-expert parameters on one rank: Ψ_E / (pp · ep)."""
    return expert_params(model) / (pp * ep)


def rank_layer_params(model, *, tp: int = 1, ep: int = 1) -> float:
    """The largest block on one rank: dense part / tp + routed experts / ep (ZeRO-3 gathers a
    block at a time)."""
    return max((model.layer_params(i) - layer_expert_params(model, i)) / tp
               + layer_expert_params(model, i) / ep for i in range(model.n_layers))


def routed_copies(model) -> float:
    """k': expert slots per token, top_k dropless or capacity_factor · top_k (docstring)."""
    m = model.moe
    return m.top_k * m.capacity_factor if m.capacity_factor > 0 else float(m.top_k)


def rank_tokens(layout: Layout, *, seq_len: int, micro_batch_size: int) -> float:
    """T: tokens one rank routes per micro-batch; `seq_len` already divided by cp."""
    return seq_len * micro_batch_size / (layout.tp if layout.sp else 1)


def a2a_bytes(model, *, tokens: float, ep: int, elem_bytes: int) -> float:
    """V: bytes one all-to-all sends from one rank, T·k'·h·bytes·(ep−1)/ep."""
    return tokens * routed_copies(model) * model.dim * elem_bytes * (ep - 1) / ep


def a2a_time(nbytes: float, cluster: ClusterSpec, layout: Layout) -> float:
    """Seconds of one all-to-all sending `nbytes` per rank over the ep group (docstring)."""
    ep, g = layout.ep, cluster.gpus_per_node
    if ep == 1:
        return 0.0
    stride = layout.dims.stride("ep")
    if ep * stride <= g:
        return nbytes / cluster.intra_bw + (ep - 1) * cluster.latency_intra
    local = min(ep, max(1, g // stride))
    per_peer = nbytes / (ep - 1)
    on_node = (local - 1) * per_peer / cluster.intra_bw
    off_node = (ep - local) * per_peer / (cluster.inter_bw / g)
    return max(on_node, off_node) + (ep - 1) * cluster.latency_inter


def expert_degrees(model, dp: int) -> list[int]:
    """ep degrees the search tries: divisors of dp that divide num_experts ([1] if dense)."""
    if not is_moe(model):
        return [1]
    return [e for e in range(1, dp + 1) if dp % e == 0 and model.moe.num_experts % e == 0]
