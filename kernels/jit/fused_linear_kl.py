"""Triton device code of kernels/fused_linear_kl.py: the per-row distillation divergences (loss and
gradient over the student logits). Only @triton.jit functions live here; the launchers,
autograd, custom ops and dispatch are in kernels/fused_linear_kl.py, which imports this module
on the first launch (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def _log_m(logp, logq, log_beta, log1m_beta):
    # log m = log(beta q + (1 - beta) p) as a logaddexp: finite even where q or p underflow
    a = logq + log_beta
    b = logp + log1m_beta
    hi = tl.maximum(a, b)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))


@triton.jit
def _log_probs(ptr, cols, n_cols, inv_temp, lse):
    # padded columns load 0 (not -inf: no inf - inf NaNs downstream) and get probability 0
    mask = cols < n_cols
    logp = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse
    return logp, tl.where(mask, tl.exp(logp), 0.0)


@triton.jit
def distill_rows_kernel(
    s_ptr, s_stride, t_ptr, t_stride, keep_ptr, loss_ptr, scale_ptr,
    n_cols, inv_temp, loss_scale, beta, log_beta, log1m_beta,
    BLOCK: tl.constexpr, KIND: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_ptr += row * s_stride
    t_ptr += row * t_stride
    cols = tl.arange(0, BLOCK)

    if tl.load(keep_ptr + row) == 0:  # unscored token: no loss, zero gradient
        if WRITE_GRAD:
            for off in range(0, n_cols, BLOCK):
                tl.store(s_ptr + off + cols, tl.zeros([BLOCK], tl.float32), mask=off + cols < n_cols)
        tl.store(loss_ptr + row, 0.0)
        return

    # pass 1: both logsumexps, online
    m_s = float("-inf")
    d_s = 0.0
    m_t = float("-inf")
    d_t = 0.0
    for off in range(0, n_cols, BLOCK):
        mask = off + cols < n_cols
        s = tl.load(s_ptr + off + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        t = tl.load(t_ptr + off + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        new_s = tl.maximum(m_s, tl.max(s, 0))
        new_t = tl.maximum(m_t, tl.max(t, 0))
        d_s = d_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(s - new_s), 0)
        d_t = d_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(t - new_t), 0)
        m_s = new_s
        m_t = new_t
    lse_s = m_s + tl.log(d_s)
    lse_t = m_t + tl.log(d_t)

    # pass 2: the divergence and c (reverse KL: D; JSD: KL(p||m)); 0 log 0 = 0 via the where()s
    div = 0.0
    c = 0.0
    for off in range(0, n_cols, BLOCK):
        logp, p = _log_probs(s_ptr, off + cols, n_cols, inv_temp, lse_s)
        logq, q = _log_probs(t_ptr, off + cols, n_cols, inv_temp, lse_t)
        if KIND == 0:
            div += tl.sum(tl.where(q > 0, q * (logq - logp), 0.0), 0)
        elif KIND == 1:
            div += tl.sum(tl.where(p > 0, p * (logp - logq), 0.0), 0)
        else:
            logm = _log_m(logp, logq, log_beta, log1m_beta)
            kl_pm = tl.sum(tl.where(p > 0, p * (logp - logm), 0.0), 0)
            kl_qm = tl.sum(tl.where(q > 0, q * (logq - logm), 0.0), 0)
            div += beta * kl_qm + (1.0 - beta) * kl_pm
            c += kl_pm
    if KIND == 1:
        c = div
    tl.store(loss_ptr + row, div * loss_scale)

    # pass 3: dD/dz_S = dD/ds / T, times the mean's T^2 / n (folded into scale by the launcher)
    if WRITE_GRAD:
        scale = tl.load(scale_ptr).to(tl.float32)
        for off in range(0, n_cols, BLOCK):
            logp, p = _log_probs(s_ptr, off + cols, n_cols, inv_temp, lse_s)
            logq, q = _log_probs(t_ptr, off + cols, n_cols, inv_temp, lse_t)
            if KIND == 0:
                g = p - q
            elif KIND == 1:
                g = tl.where(p > 0, p * (logp - logq - c), 0.0)
            else:
                logm = _log_m(logp, logq, log_beta, log1m_beta)
                g = tl.where(p > 0, (1.0 - beta) * p * (logp - logm - c), 0.0)
            tl.store(s_ptr + off + cols, (g * scale).to(s_ptr.dtype.element_ty), mask=off + cols < n_cols)
