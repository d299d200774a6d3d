"""The Triton kernels of grouped attention (the autograd Function and the layout are in triton_op.py).

Pairs (query rows) are sorted by expert: ``order`` [P'] lists them, expert x owning
order[offsets[x] : offsets[x + 1]]. A work item is up to BLOCK_Q consecutive sorted pairs of one
expert. Expert x reads keys[x] [S, D] and, with a shared table, shared_keys[x // group] [M, D]
placed before them; both are read by index from the tables, a block of BLOCK_K keys at a time.

Every program writes its own rows only: the forward and dq kernels the rows of their work item's
pairs (the dq kernel also their backward offsets, which the dK/dV kernel, launched after it, reads),
the dK/dV kernel one block of one expert's keys (a shared block is written per expert, and
triton_op.py sums the group's partials). No atomics are used, so results are deterministic.
"""
import triton
import triton.language as tl


@triton.jit
def _load_rows(table_ptr, row, first, LENGTH, D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """table[row, first : first + BLOCK_K] of a [*, LENGTH, D] table, zeros past LENGTH -> [BLOCK_K, BLOCK_D]."""
    k = first + tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    # a 64-bit base (tables can pass 2^31 elements) and 32-bit offsets inside the row
    base = table_ptr + row.to(tl.int64) * LENGTH * D
    return tl.load(base + k[:, None] * D + d[None, :], mask=(k[:, None] < LENGTH) & (d[None, :] < D), other=0.0)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b accumulated in float32. DOT is tl.dot's input precision ("ieee": exact float32 products),
    or "upcast": both cast to float32 first, for Triton's interpreter, whose dot cannot multiply bf16."""
    if DOT == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT)


@triton.jit
def _key_ok(ok_ptr, row, first, LENGTH, HAS_OK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Which of keys first .. first + BLOCK_K of table row ``row`` are real (ok [*, LENGTH] uint8) -> [BLOCK_K]."""
    k = first + tl.arange(0, BLOCK_K)
    ok = k < LENGTH
    if HAS_OK:
        ok = ok & (tl.load(ok_ptr + row.to(tl.int64) * LENGTH + k, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _forward_block(q, m_i, l_i, acc, keys_ptr, values_ptr, ok_ptr, row, first, LENGTH, scale,
                   D: tl.constexpr, HAS_OK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT: tl.constexpr):
    """One online-softmax step of q [BLOCK_Q, BLOCK_D] over a block of BLOCK_K keys of table row ``row``."""
    k = _load_rows(keys_ptr, row, first, LENGTH, D, BLOCK_K, BLOCK_D)  # [BLOCK_K, BLOCK_D]
    v = _load_rows(values_ptr, row, first, LENGTH, D, BLOCK_K, BLOCK_D)
    ok = _key_ok(ok_ptr, row, first, LENGTH, HAS_OK, BLOCK_K)
    s = _dot(q, tl.trans(k), DOT) * scale  # [BLOCK_Q, BLOCK_K]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with no real key so far keeps max -inf; exp(s - 0) = 0 there instead of exp(-inf + inf) = nan
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
    return m_new, l_i, acc


@triton.jit
def grouped_forward(
    q_ptr, order_ptr, item_expert_ptr, item_first_ptr, item_rows_ptr,
    keys_ptr, values_ptr, key_ok_ptr, shared_keys_ptr, shared_values_ptr, shared_ok_ptr,
    out_ptr, lse_ptr,
    S, M, group, scale,
    D: tl.constexpr, HAS_KEY_OK: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_SHARED_OK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
):
    """One work item: out [rows, D] and lse [rows] (float32) of its pairs, written at the pairs' rows."""
    item = tl.program_id(0)
    rows = tl.load(item_rows_ptr + item)
    # items past the last real one (the grid is an upper bound, known without reading the device)
    if rows == 0:
        return
    expert = tl.load(item_expert_ptr + item)
    r = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    pair = tl.load(order_ptr + tl.load(item_first_ptr + item) + r, mask=r < rows, other=0).to(tl.int64)  # [BLOCK_Q]
    io_mask = (r[:, None] < rows) & (d[None, :] < D)
    q = tl.load(q_ptr + pair[:, None] * D + d[None, :], mask=io_mask, other=0.0)  # [BLOCK_Q, BLOCK_D]
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    if HAS_SHARED:
        for first in range(0, M, BLOCK_K):
            m_i, l_i, acc = _forward_block(q, m_i, l_i, acc, shared_keys_ptr, shared_values_ptr, shared_ok_ptr,
                                           expert // group, first, M, scale,
                                           D, HAS_SHARED_OK, BLOCK_K, BLOCK_D, DOT)
    for first in range(0, S, BLOCK_K):
        m_i, l_i, acc = _forward_block(q, m_i, l_i, acc, keys_ptr, values_ptr, key_ok_ptr, expert, first, S, scale,
                                       D, HAS_KEY_OK, BLOCK_K, BLOCK_D, DOT)
    # a pair whose keys are all masked gets out 0 and lse -inf, as a pair with no expert
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(out_ptr + pair[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
    tl.store(lse_ptr + pair, lse, mask=r < rows)


@triton.jit
def _dq_block(q, d_out, lse, offset, dq, keys_ptr, values_ptr, ok_ptr, row, first, LENGTH, scale,
              D: tl.constexpr, HAS_OK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
              DOT: tl.constexpr):
    """dq [BLOCK_Q, BLOCK_D] plus d_logits K over a block of BLOCK_K keys of table row ``row`` (the
    caller multiplies the sum by scale)."""
    k = _load_rows(keys_ptr, row, first, LENGTH, D, BLOCK_K, BLOCK_D)  # [BLOCK_K, BLOCK_D]
    v = _load_rows(values_ptr, row, first, LENGTH, D, BLOCK_K, BLOCK_D)
    ok = _key_ok(ok_ptr, row, first, LENGTH, HAS_OK, BLOCK_K)
    s = _dot(q, tl.trans(k), DOT) * scale  # [BLOCK_Q, BLOCK_K]
    p = tl.exp(tl.where(ok[None, :], s, float("-inf")) - lse[:, None])
    d_logits = p * (_dot(d_out, tl.trans(v), DOT) + offset[:, None])
    return dq + _dot(d_logits.to(k.dtype), k, DOT)


@triton.jit
def grouped_backward_dq(
    q_ptr, d_out_ptr, out_ptr, d_lse_ptr, lse_ptr, offset_ptr, order_ptr, item_expert_ptr, item_first_ptr,
    item_rows_ptr, keys_ptr, values_ptr, key_ok_ptr, shared_keys_ptr, shared_values_ptr, shared_ok_ptr,
    dq_ptr,
    S, M, group, scale,
    D: tl.constexpr, HAS_KEY_OK: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_SHARED_OK: tl.constexpr,
    HAS_DLSE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT: tl.constexpr,
):
    """One work item: dq [rows, D] of its pairs, the softmax recomputed from the saved lse; and each
    pair's offset = d_lse - d_out . out (float32), written for the dK/dV kernel that runs next."""
    item = tl.program_id(0)
    rows = tl.load(item_rows_ptr + item)
    if rows == 0:
        return
    expert = tl.load(item_expert_ptr + item)
    r = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    pair = tl.load(order_ptr + tl.load(item_first_ptr + item) + r, mask=r < rows, other=0).to(tl.int64)  # [BLOCK_Q]
    io_mask = (r[:, None] < rows) & (d[None, :] < D)
    q = tl.load(q_ptr + pair[:, None] * D + d[None, :], mask=io_mask, other=0.0)  # [BLOCK_Q, BLOCK_D]
    d_out = tl.load(d_out_ptr + pair[:, None] * D + d[None, :], mask=io_mask, other=0.0)
    lse = tl.load(lse_ptr + pair, mask=r < rows, other=float("inf"))  # [BLOCK_Q]
    # lse -inf (no real key) -> +inf, so that every p = exp(s - lse) is 0 rather than nan
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    out = tl.load(out_ptr + pair[:, None] * D + d[None, :], mask=io_mask, other=0.0)
    offset = -tl.sum(d_out.to(tl.float32) * out.to(tl.float32), 1)  # [BLOCK_Q] d_lse - d_out . out
    if HAS_DLSE:
        offset += tl.load(d_lse_ptr + pair, mask=r < rows, other=0.0).to(tl.float32)
    tl.store(offset_ptr + pair, offset, mask=r < rows)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    if HAS_SHARED:
        for first in range(0, M, BLOCK_K):
            dq = _dq_block(q, d_out, lse, offset, dq, shared_keys_ptr, shared_values_ptr, shared_ok_ptr,
                           expert // group, first, M, scale, D, HAS_SHARED_OK, BLOCK_K, BLOCK_D, DOT)
    for first in range(0, S, BLOCK_K):
        dq = _dq_block(q, d_out, lse, offset, dq, keys_ptr, values_ptr, key_ok_ptr, expert, first, S, scale,
                       D, HAS_KEY_OK, BLOCK_K, BLOCK_D, DOT)
    tl.store(dq_ptr + pair[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _dkdv_block(q_ptr, d_out_ptr, lse_ptr, offset_ptr, order_ptr, begin, end,
                keys_ptr, values_ptr, ok_ptr, row, first, LENGTH, d_keys_ptr, d_values_ptr, out_row, scale,
                D: tl.constexpr, HAS_OK: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """dK, dV of keys first .. first + BLOCK_K of table row ``row`` from sorted pairs begin .. end,
    written to row ``out_row`` of d_keys, d_values ([*, LENGTH, D])."""
    k = _load_rows(keys_ptr, row, first, LENGTH, D, BLOCK_K, BLOCK_D)  # [BLOCK_K, BLOCK_D]
    v = _load_rows(values_ptr, row, first, LENGTH, D, BLOCK_K, BLOCK_D)
    ok = _key_ok(ok_ptr, row, first, LENGTH, HAS_OK, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_Q):
        r = start + tl.arange(0, BLOCK_Q)
        pair = tl.load(order_ptr + r, mask=r < end, other=0).to(tl.int64)  # [BLOCK_Q]
        io_mask = (r[:, None] < end) & (d[None, :] < D)
        q = tl.load(q_ptr + pair[:, None] * D + d[None, :], mask=io_mask, other=0.0)  # [BLOCK_Q, BLOCK_D]
        d_out = tl.load(d_out_ptr + pair[:, None] * D + d[None, :], mask=io_mask, other=0.0)
        lse = tl.load(lse_ptr + pair, mask=r < end, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        offset = tl.load(offset_ptr + pair, mask=r < end, other=0.0)
        s = _dot(q, tl.trans(k), DOT) * scale  # [BLOCK_Q, BLOCK_K]
        p = tl.exp(tl.where(ok[None, :], s, float("-inf")) - lse[:, None])
        dv += _dot(tl.trans(p).to(d_out.dtype), d_out, DOT)
        d_logits = p * (_dot(d_out, tl.trans(v), DOT) + offset[:, None])
        dk += _dot(tl.trans(d_logits).to(q.dtype), q, DOT)
    kk = first + tl.arange(0, BLOCK_K)
    base = out_row.to(tl.int64) * LENGTH * D
    offsets = kk[:, None] * D + d[None, :]
    io_mask = (kk[:, None] < LENGTH) & (d[None, :] < D)
    tl.store(d_keys_ptr + base + offsets, (dk * scale).to(d_keys_ptr.dtype.element_ty), mask=io_mask)
    tl.store(d_values_ptr + base + offsets, dv.to(d_values_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def grouped_backward_dkdv(
    q_ptr, d_out_ptr, lse_ptr, offset_ptr, order_ptr, offsets_ptr,
    keys_ptr, values_ptr, key_ok_ptr, shared_keys_ptr, shared_values_ptr, shared_ok_ptr,
    d_keys_ptr, d_values_ptr, d_shared_keys_ptr, d_shared_values_ptr,
    S, M, group, scale,
    D: tl.constexpr, HAS_KEY_OK: tl.constexpr, HAS_SHARED_OK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
):
    """Program (expert x, key block j): block j of x's own keys (j < cdiv(S, BLOCK_K)), else a block of
    its group's shared keys, written to x's own row of the per-expert partials d_shared_* [X, M, D]."""
    expert = tl.program_id(0)
    block = tl.program_id(1)
    begin = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    own_blocks = tl.cdiv(S, BLOCK_K)
    if block < own_blocks:
        _dkdv_block(q_ptr, d_out_ptr, lse_ptr, offset_ptr, order_ptr, begin, end,
                    keys_ptr, values_ptr, key_ok_ptr, expert, block * BLOCK_K, S, d_keys_ptr, d_values_ptr, expert,
                    scale, D, HAS_KEY_OK, BLOCK_Q, BLOCK_K, BLOCK_D, DOT)
    else:
        _dkdv_block(q_ptr, d_out_ptr, lse_ptr, offset_ptr, order_ptr, begin, end,
                    shared_keys_ptr, shared_values_ptr, shared_ok_ptr, expert // group, (block - own_blocks) * BLOCK_K,
                    M, d_shared_keys_ptr, d_shared_values_ptr, expert, scale, D, HAS_SHARED_OK,
                    BLOCK_Q, BLOCK_K, BLOCK_D, DOT)
