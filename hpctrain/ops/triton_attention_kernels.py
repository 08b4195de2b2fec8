"""hpctrain's FlashAttention-2 kernels in Triton: forward, dq, and dk/dv.

Legend: B batch, N query heads, K key/value heads, G = N/K query heads per kv head, L sequence,
H head dim (padded to the power of two HP ≥ 16 inside a tile), BM query rows and BN key rows per
tile. Scores are kept in log2 units: s2 = q·k · (1/√H) · log2(e), so exp2 replaces exp and the
saved log-sum-exp LSE2[b, n, i] = log2 Σ_j exp2(s2_ij) over the keys that row i may see.

    forward  one program per (query tile, b·N + n): online softmax over the key tiles the tile
             may see; O = Σ p v / Σ p, never an L×L block in memory; stores O and LSE2.
    dq       one program per (query tile, b·N + n): p = exp2(s2 − LSE2), dS = p ∘ (dO vᵀ − Δ),
             dq = dS k / √H, with Δ_i = Σ_h dO_ih O_ih (rowsum, computed by the caller).
    dk/dv    one program per (key tile, b·K + kh): loops over the G query heads of the group
             and the query tiles that can see the tile; dv = pᵀ dO, dk = dSᵀ q / √H. No atomics.

Masks: key j is visible to query i iff j ≤ i (when CAUSAL) and (with documents)
IDS[b, i] == IDS_K[b, j]; rows and keys past L are masked by bounds, so L need not be a multiple
of the tile. One sequence attending to itself passes CAUSAL and IDS_K = IDS; a block of context
parallelism (ops/triton_attention_block.py) passes its query and key chunks' ids, and CAUSAL
off when every key of the block precedes every query (the key chunk is an earlier one). Per tile the
caller passes three bounds (triton_attention.query_tile_ranges / key_tile_ranges): tiles outside
[lo, hi) are never visited (no query of the tile can see them: before the first query's
document, after the last key's document, or causally later), and tiles inside [free_lo, free_hi)
are visible to every row, so they skip the mask; only the rest are masked. The kv head of query
head n is n // G: k and v are indexed, never copied.

ACC is the accumulation dtype (fp32, or fp64 for fp64 inputs); LSE2 and Δ are stored in it.
The scales are compile-time constants: exact in fp64 under the interpreter (a float argument
would be rounded to fp32), and one compiled variant per head dim on the GPU.
Importing this module jits the kernels in the process's Triton mode (compiled, or the CPU
interpreter under TRITON_INTERPRET=1): `triton_attention` imports it on first use.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(base, offs, stride, offs_h, ok, h_ok):
    """Rows `offs` of one head's [L, H] matrix (row stride `stride`); zeros past L and H."""
    return tl.load(base + offs[:, None] * stride + offs_h[None, :],
                   mask=ok[:, None] & h_ok[None, :], other=0.0)


@triton.jit
def _store_rows(base, offs, stride, offs_h, ok, h_ok, value):
    tl.store(base + offs[:, None] * stride + offs_h[None, :], value,
             mask=ok[:, None] & h_ok[None, :])


@triton.jit
def _ids(IDS, row, offs, ok, HAS_DOCS: tl.constexpr):
    """Document ids of positions `offs` of the row starting at IDS + row (without documents
    IDS is None and the result unused placeholders)."""
    if HAS_DOCS:
        ids = tl.load(IDS + row + offs, mask=ok, other=-1)
    else:
        ids = offs
    return ids


@triton.jit
def _visible(q_idx, k_idx, q_ok, k_ok, q_ids, k_ids, HAS_DOCS: tl.constexpr,
             CAUSAL: tl.constexpr):
    """Which (query, key) pairs may attend — causal (if CAUSAL), both inside L, same
    document — for broadcastable index blocks ([BM, 1] against [1, BN], or the transpose)."""
    keep = q_ok & k_ok
    if CAUSAL:
        keep = keep & (q_idx >= k_idx)
    if HAS_DOCS:
        keep = keep & (q_ids == k_ids)
    return keep


@triton.jit
def _query_tile_end(tile, L, BM: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key a query tile may see: its own last row (causal), else L."""
    if CAUSAL:
        end = tl.minimum((tile + 1) * BM, L)
    else:
        end = L
    return end


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k_base, v_base, skl, svl, start, offs_m, m_ok, ids_q, offs_h,
              h_ok, IDS_K, b, L, QK_SCALE2: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr,
              HAS_DOCS: tl.constexpr, PREC: tl.constexpr, CAUSAL: tl.constexpr):
    """The online softmax over one key tile (keys start … start + BN): (acc, m_i, l_i) updated."""
    offs_n = start + tl.arange(0, BN)
    n_ok = offs_n < L
    k = _load_rows(k_base, offs_n, skl, offs_h, n_ok, h_ok)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * QK_SCALE2
    if MASKED:
        keep = _visible(offs_m[:, None], offs_n[None, :], m_ok[:, None], n_ok[None, :],
                        ids_q[:, None], _ids(IDS_K, b * L, offs_n, n_ok, HAS_DOCS)[None, :],
                        HAS_DOCS, CAUSAL)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that sees no key of this tile keeps max −inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = _load_rows(v_base, offs_n, svl, offs_h, n_ok, h_ok)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def attn_fwd(Q, K, V, O, LSE, IDS, IDS_K, RANGES,
             sqb, sqn, sql, skb, skn, skl, svb, svn, svl, sob, son, sol, srb,
             L, H, N, G,
             QK_SCALE2: tl.constexpr, HAS_DOCS: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, HP: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
             CAUSAL: tl.constexpr):
    tile, bn = tl.program_id(0), tl.program_id(1)
    b, n = (bn // N).to(tl.int64), bn % N
    kh = (n // G).to(tl.int64)
    offs_m, offs_h = tile * BM + tl.arange(0, BM), tl.arange(0, HP)
    m_ok, h_ok = offs_m < L, offs_h < H
    q = _load_rows(Q + b * sqb + n * sqn, offs_m, sql, offs_h, m_ok, h_ok)
    ids_q = _ids(IDS, b * L, offs_m, m_ok, HAS_DOCS)
    r = RANGES + b * srb + tile * 3
    bounds = (tl.load(r), tl.load(r + 1), tl.load(r + 2), _query_tile_end(tile, L, BM, CAUSAL))
    k_base, v_base = K + b * skb + kh * skn, V + b * svb + kh * svn
    m_i = tl.full([BM], float("-inf"), ACC)
    l_i = tl.zeros([BM], ACC)
    acc = tl.zeros([BM, HP], ACC)
    for part in tl.static_range(3):  # masked, mask-free, masked
        for start in range(bounds[part], bounds[part + 1], BN):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, skl, svl, start, offs_m,
                                      m_ok, ids_q, offs_h, h_ok, IDS_K, b, L, QK_SCALE2, BN,
                                      part != 1, HAS_DOCS, PREC, CAUSAL)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only rows past L see no key at all
    _store_rows(O + b * sob + n * son, offs_m, sol, offs_h, m_ok, h_ok, acc / l_safe[:, None])
    tl.store(LSE + bn.to(tl.int64) * L + offs_m, m_i + tl.log2(l_safe), mask=m_ok)


@triton.jit
def _dq_step(dq, q, do, lse, delta, k_base, v_base, skl, svl, start, offs_m, m_ok, ids_q,
             offs_h, h_ok, IDS_K, b, L, QK_SCALE2: tl.constexpr, BN: tl.constexpr,
             MASKED: tl.constexpr, HAS_DOCS: tl.constexpr, PREC: tl.constexpr,
             CAUSAL: tl.constexpr):
    """dq += dS k over one key tile, with p = exp2(s2 − LSE2) and dS = p ∘ (dO vᵀ − Δ)."""
    offs_n = start + tl.arange(0, BN)
    n_ok = offs_n < L
    k = _load_rows(k_base, offs_n, skl, offs_h, n_ok, h_ok)
    v = _load_rows(v_base, offs_n, svl, offs_h, n_ok, h_ok)
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * QK_SCALE2 - lse[:, None])
    if MASKED:
        keep = _visible(offs_m[:, None], offs_n[None, :], m_ok[:, None], n_ok[None, :],
                        ids_q[:, None], _ids(IDS_K, b * L, offs_n, n_ok, HAS_DOCS)[None, :],
                        HAS_DOCS, CAUSAL)
        p = tl.where(keep, p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)


@triton.jit
def attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, IDS, IDS_K, RANGES,
                sqb, sqn, sql, skb, skn, skl, svb, svn, svl, sdb, sdn, sdl, sgb, sgn, sgl, srb,
                L, H, N, G,
                QK_SCALE2: tl.constexpr, SM_SCALE: tl.constexpr, HAS_DOCS: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, PREC: tl.constexpr,
                ACC: tl.constexpr, CAUSAL: tl.constexpr):
    tile, bn = tl.program_id(0), tl.program_id(1)
    b, n = (bn // N).to(tl.int64), bn % N
    kh = (n // G).to(tl.int64)
    offs_m, offs_h = tile * BM + tl.arange(0, BM), tl.arange(0, HP)
    m_ok, h_ok = offs_m < L, offs_h < H
    q = _load_rows(Q + b * sqb + n * sqn, offs_m, sql, offs_h, m_ok, h_ok)
    do = _load_rows(DO + b * sdb + n * sdn, offs_m, sdl, offs_h, m_ok, h_ok)
    lse = tl.load(LSE + bn.to(tl.int64) * L + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + bn.to(tl.int64) * L + offs_m, mask=m_ok, other=0.0)
    ids_q = _ids(IDS, b * L, offs_m, m_ok, HAS_DOCS)
    r = RANGES + b * srb + tile * 3
    bounds = (tl.load(r), tl.load(r + 1), tl.load(r + 2), _query_tile_end(tile, L, BM, CAUSAL))
    k_base, v_base = K + b * skb + kh * skn, V + b * svb + kh * svn
    dq = tl.zeros([BM, HP], ACC)
    for part in tl.static_range(3):  # masked, mask-free, masked
        for start in range(bounds[part], bounds[part + 1], BN):
            dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, skl, svl, start, offs_m, m_ok,
                          ids_q, offs_h, h_ok, IDS_K, b, L, QK_SCALE2, BN, part != 1, HAS_DOCS,
                          PREC, CAUSAL)
    _store_rows(DQ + b * sgb + n * sgn, offs_m, sgl, offs_h, m_ok, h_ok, dq * SM_SCALE)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, sql, sdl, lse_row, delta_row, start, offs_n,
               n_ok, ids_k, offs_h, h_ok, IDS, b, L, QK_SCALE2: tl.constexpr, BM: tl.constexpr,
               MASKED: tl.constexpr, HAS_DOCS: tl.constexpr, PREC: tl.constexpr,
               CAUSAL: tl.constexpr):
    """dv += pᵀ dO and dk += dSᵀ q over one query tile (queries start … start + BM)."""
    offs_m = start + tl.arange(0, BM)
    m_ok = offs_m < L
    q = _load_rows(q_base, offs_m, sql, offs_h, m_ok, h_ok)
    do = _load_rows(do_base, offs_m, sdl, offs_h, m_ok, h_ok)
    lse = tl.load(lse_row + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(delta_row + offs_m, mask=m_ok, other=0.0)
    p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * QK_SCALE2 - lse[None, :])
    if MASKED:
        keep = _visible(offs_m[None, :], offs_n[:, None], m_ok[None, :], n_ok[:, None],
                        _ids(IDS, b * L, offs_m, m_ok, HAS_DOCS)[None, :], ids_k[:, None],
                        HAS_DOCS, CAUSAL)
        p_t = tl.where(keep, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
    ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
    return dk + tl.dot(ds_t.to(q.dtype), q, input_precision=PREC), dv


@triton.jit
def attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, IDS, IDS_K, RANGES,
                  sqb, sqn, sql, skb, skn, skl, svb, svn, svl, sdb, sdn, sdl,
                  sgb, sgn, sgl, swb, swn, swl, srb,
                  L, H, KV, G,
                  QK_SCALE2: tl.constexpr, SM_SCALE: tl.constexpr, HAS_DOCS: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, PREC: tl.constexpr,
                  ACC: tl.constexpr, CAUSAL: tl.constexpr):
    tile, bk = tl.program_id(0), tl.program_id(1)
    b, kh = (bk // KV).to(tl.int64), (bk % KV).to(tl.int64)
    offs_n, offs_h = tile * BN + tl.arange(0, BN), tl.arange(0, HP)
    n_ok, h_ok = offs_n < L, offs_h < H
    k = _load_rows(K + b * skb + kh * skn, offs_n, skl, offs_h, n_ok, h_ok)
    v = _load_rows(V + b * svb + kh * svn, offs_n, svl, offs_h, n_ok, h_ok)
    ids_k = _ids(IDS_K, b * L, offs_n, n_ok, HAS_DOCS)
    r = RANGES + b * srb + tile * 3
    first = (tile * BN // BM) * BM if CAUSAL else 0  # causally, earlier queries never see it
    bounds = (first, tl.load(r), tl.load(r + 1), tl.load(r + 2))
    dk = tl.zeros([BN, HP], ACC)
    dv = tl.zeros([BN, HP], ACC)
    for g in range(0, G):  # the query heads sharing this kv head: no atomics needed
        n = kh * G + g
        row = (b * G * KV + n) * L  # LSE / DELTA row of (b, n)
        for part in tl.static_range(3):  # masked, mask-free, masked
            for start in range(bounds[part], bounds[part + 1], BM):
                dk, dv = _dkdv_step(dk, dv, k, v, Q + b * sqb + n * sqn, DO + b * sdb + n * sdn,
                                    sql, sdl, LSE + row, DELTA + row, start, offs_n, n_ok, ids_k,
                                    offs_h, h_ok, IDS, b, L, QK_SCALE2, BM, part != 1, HAS_DOCS,
                                    PREC, CAUSAL)
    _store_rows(DK + b * sgb + kh * sgn, offs_n, sgl, offs_h, n_ok, h_ok, dk * SM_SCALE)
    _store_rows(DV + b * swb + kh * swn, offs_n, swl, offs_h, n_ok, h_ok, dv)
