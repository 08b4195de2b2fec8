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

Masks: key j is visible to query i iff j ≤ i and (with documents) ids[b, i] == ids[b, j]; rows
and keys past L are masked by bounds, so L need not be a multiple of the tile. Whole tiles that
no query of a tile can see are never visited: the caller passes, per tile, the first key
(KV_LO, the start of the first query's document, rounded down to BN) and the end of the last
visible query (Q_HI, the end of the last key's document); without documents the causal bounds
are used. The kv head of query head n is n // G: k and v are indexed, never copied.

ACC is the accumulation dtype (fp32, or fp64 for fp64 inputs); LSE2 and Δ are stored in it.
The scales are compile-time constants: exact in fp64 under the interpreter (a float argument
would be rounded to fp32), and one compiled variant per head dim on the GPU.
The functions here are undecorated: `triton_attention.kernels` wraps them with `triton.jit`
once for the GPU and once for Triton's CPU interpreter.
"""

from __future__ import annotations

import triton.language as tl


def attn_fwd(Q, K, V, O, LSE, IDS, KV_LO,
             sqb, sqn, sql, skb, skn, skl, svb, svn, svl, sob, son, sol,
             L, H, N, G,
             QK_SCALE2: tl.constexpr, HAS_DOCS: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, HP: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    tile, bn = tl.program_id(0), tl.program_id(1)
    b, n = (bn // N).to(tl.int64), bn % N
    kh = (n // G).to(tl.int64)
    offs_m = tile * BM + tl.arange(0, BM)
    offs_h = tl.arange(0, HP)
    m_ok, h_ok = offs_m < L, offs_h < H
    q = tl.load(Q + b * sqb + n * sqn + offs_m[:, None] * sql + offs_h[None, :],
                mask=m_ok[:, None] & h_ok[None, :], other=0.0)
    k_base, v_base = K + b * skb + kh * skn, V + b * svb + kh * svn
    lo, hi = 0, tl.minimum((tile + 1) * BM, L)
    if HAS_DOCS:
        ids_q = tl.load(IDS + b * L + offs_m, mask=m_ok, other=-1)
        lo = tl.load(KV_LO + b * tl.cdiv(L, BM) + tile)
    m_i = tl.full([BM], float("-inf"), ACC)
    l_i = tl.zeros([BM], ACC)
    acc = tl.zeros([BM, HP], ACC)
    for start in range(lo, hi, BN):
        offs_n = start + tl.arange(0, BN)
        n_ok = offs_n < L
        kv_mask = n_ok[:, None] & h_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * skl + offs_h[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * QK_SCALE2
        keep = (offs_m[:, None] >= offs_n[None, :]) & n_ok[None, :]
        if HAS_DOCS:
            ids_k = tl.load(IDS + b * L + offs_n, mask=n_ok, other=-2)
            keep = keep & (ids_q[:, None] == ids_k[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees no key of this tile keeps max −inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * svl + offs_h[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only rows past L see no key at all
    acc = acc / l_safe[:, None]
    tl.store(O + b * sob + n * son + offs_m[:, None] * sol + offs_h[None, :], acc,
             mask=m_ok[:, None] & h_ok[None, :])
    tl.store(LSE + bn.to(tl.int64) * L + offs_m, m_i + tl.log2(l_safe), mask=m_ok)


def attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, IDS, KV_LO,
                sqb, sqn, sql, skb, skn, skl, svb, svn, svl, sdb, sdn, sdl, sgb, sgn, sgl,
                L, H, N, G,
                QK_SCALE2: tl.constexpr, SM_SCALE: tl.constexpr, HAS_DOCS: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, PREC: tl.constexpr,
                ACC: tl.constexpr):
    tile, bn = tl.program_id(0), tl.program_id(1)
    b, n = (bn // N).to(tl.int64), bn % N
    kh = (n // G).to(tl.int64)
    offs_m = tile * BM + tl.arange(0, BM)
    offs_h = tl.arange(0, HP)
    m_ok, h_ok = offs_m < L, offs_h < H
    row_mask = m_ok[:, None] & h_ok[None, :]
    q = tl.load(Q + b * sqb + n * sqn + offs_m[:, None] * sql + offs_h[None, :],
                mask=row_mask, other=0.0)
    do = tl.load(DO + b * sdb + n * sdn + offs_m[:, None] * sdl + offs_h[None, :],
                 mask=row_mask, other=0.0)
    lse = tl.load(LSE + bn.to(tl.int64) * L + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + bn.to(tl.int64) * L + offs_m, mask=m_ok, other=0.0)
    k_base, v_base = K + b * skb + kh * skn, V + b * svb + kh * svn
    lo, hi = 0, tl.minimum((tile + 1) * BM, L)
    if HAS_DOCS:
        ids_q = tl.load(IDS + b * L + offs_m, mask=m_ok, other=-1)
        lo = tl.load(KV_LO + b * tl.cdiv(L, BM) + tile)
    dq = tl.zeros([BM, HP], ACC)
    for start in range(lo, hi, BN):
        offs_n = start + tl.arange(0, BN)
        n_ok = offs_n < L
        kv_mask = n_ok[:, None] & h_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * skl + offs_h[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svl + offs_h[None, :], mask=kv_mask, other=0.0)
        keep = (offs_m[:, None] >= offs_n[None, :]) & n_ok[None, :] & m_ok[:, None]
        if HAS_DOCS:
            ids_k = tl.load(IDS + b * L + offs_n, mask=n_ok, other=-2)
            keep = keep & (ids_q[:, None] == ids_k[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * QK_SCALE2
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + b * sgb + n * sgn + offs_m[:, None] * sgl + offs_h[None, :], dq * SM_SCALE,
             mask=row_mask)


def attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, IDS, Q_HI,
                  sqb, sqn, sql, skb, skn, skl, svb, svn, svl, sdb, sdn, sdl,
                  sgb, sgn, sgl, swb, swn, swl,
                  L, H, KV, G,
                  QK_SCALE2: tl.constexpr, SM_SCALE: tl.constexpr, HAS_DOCS: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, PREC: tl.constexpr,
                  ACC: tl.constexpr):
    tile, bk = tl.program_id(0), tl.program_id(1)
    b, kh = (bk // KV).to(tl.int64), (bk % KV).to(tl.int64)
    offs_n = tile * BN + tl.arange(0, BN)
    offs_h = tl.arange(0, HP)
    n_ok, h_ok = offs_n < L, offs_h < H
    kv_mask = n_ok[:, None] & h_ok[None, :]
    k = tl.load(K + b * skb + kh * skn + offs_n[:, None] * skl + offs_h[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kh * svn + offs_n[:, None] * svl + offs_h[None, :],
                mask=kv_mask, other=0.0)
    lo, hi = (tile * BN // BM) * BM, L
    if HAS_DOCS:
        ids_k = tl.load(IDS + b * L + offs_n, mask=n_ok, other=-2)
        hi = tl.load(Q_HI + b * tl.cdiv(L, BN) + tile)
    dk = tl.zeros([BN, HP], ACC)
    dv = tl.zeros([BN, HP], ACC)
    for g in range(0, G):
        n = kh * G + g
        row = (b * G * KV + n) * L  # LSE / DELTA row of (b, n)
        for start in range(lo, hi, BM):
            offs_m = start + tl.arange(0, BM)
            m_ok = offs_m < L
            row_mask = m_ok[:, None] & h_ok[None, :]
            q = tl.load(Q + b * sqb + n * sqn + offs_m[:, None] * sql + offs_h[None, :],
                        mask=row_mask, other=0.0)
            do = tl.load(DO + b * sdb + n * sdn + offs_m[:, None] * sdl + offs_h[None, :],
                         mask=row_mask, other=0.0)
            lse = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
            keep = (offs_m[None, :] >= offs_n[:, None]) & m_ok[None, :] & n_ok[:, None]
            if HAS_DOCS:
                ids_q = tl.load(IDS + b * L + offs_m, mask=m_ok, other=-1)
                keep = keep & (ids_k[:, None] == ids_q[None, :])
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * QK_SCALE2
            p_t = tl.where(keep, tl.exp2(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
    tl.store(DK + b * sgb + kh * sgn + offs_n[:, None] * sgl + offs_h[None, :], dk * SM_SCALE,
             mask=kv_mask)
    tl.store(DV + b * swb + kh * swn + offs_n[:, None] * swl + offs_h[None, :], dv,
             mask=kv_mask)
