"""The Triton kernel of ``triton_step.py`` (imported only where triton is installed).

One program steps TILE consecutive elements of one of the tensors of a launch, which finds them in a table of
addresses (one launch steps every tensor of one size and one setting). bf16 tensors are read as int16 and converted
on their bit patterns (exact, and round-to-nearest-even as c10::BFloat16 on the way back), so that the interpreter
and the GPU compute the same values. Shapes in the comments: n elements of a tensor, nb blocks of a moment.
"""

import triton
import triton.language as tl

K_FP32, K_BF16, K_INT8, K_INT4 = 0, 1, 2, 3
W_NEAREST, W_STOCHASTIC, W_KAHAN = 0, 1, 2  # how a bf16 weight is written (rules.rounded)


@triton.jit
def _load(ptr, offs, mask, BF16: tl.constexpr):
    """fp32 values at offs (0 where masked) of an fp32 tensor, or of a bf16 one seen as int16."""
    if BF16:
        raw = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (raw << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _bf16_bits(x):
    """x fp32 -> its bf16 rounding (nearest, ties to even; NaN -> the canonical NaN) as int32 bit patterns."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, rounded)


@triton.jit
def _round_bf16(x):
    return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _store(ptr, offs, x, mask, BF16: tl.constexpr):
    if BF16:
        tl.store(ptr + offs, _bf16_bits(x).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _mix32(x):
    """noise._mix32_ on int64 values in [0, 2^32) (the products' low 32 bits kept: exact under wraparound)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _stochastic_bf16_bits(y, j, key0, key1):
    """quant.to_bf16(y, stochastic=True) with the counter-based stream (key0, key1) at counters j (int64): the top
    16 bits of hash(j) added to the low half of y's pattern, truncated; inf and NaN rounded to nearest."""
    h = _mix32(_mix32((j & 0xFFFFFFFF) ^ key0) ^ ((j >> 32) & 0xFFFFFFFF) ^ key1)
    bits = y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    rounded = ((bits + (h >> 16)) >> 16) & 0xFFFF
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded.to(tl.int32), _bf16_bits(y))


@triton.jit
def _lerp(a, b, w):
    """torch's lerp: fma(w, b - a, a) for |w| < 0.5, else fma(w - 1, b - a, b)."""
    diff = b - a
    return tl.where(tl.abs(w) < 0.5, tl.fma(w, diff, a), tl.fma(w - 1.0, diff, b))


@triton.jit
def _decode(data, scale, qmap, offs, mask, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """A moment's fp32 values at offs. data: (n,) fp32 | (n,) bf16 as int16 | (nb * BLOCK,) uint8 codes |
    (nb * BLOCK / 2,) uint8 code pairs (first in the high half); scale: (nb,) fp32; qmap: (2^bits,) fp32."""
    if KIND == K_FP32:
        x = _load(data, offs, mask, False)
    elif KIND == K_BF16:
        x = _load(data, offs, mask, True)
    else:
        if KIND == K_INT8:
            code = tl.load(data + offs, mask=mask, other=0).to(tl.int32)
        else:
            byte = tl.load(data + offs // 2, mask=mask, other=0).to(tl.int32)
            code = tl.where(offs % 2 == 0, byte >> 4, byte & 15)
        s = tl.load(scale + offs // BLOCK, mask=mask, other=0.0)
        x = tl.load(qmap + code, mask=mask, other=0.0) * s
    return tl.where(mask, x, 0.0)


@triton.jit
def _encode(x, data, scale, table, offs, n, nblocks, KIND: tl.constexpr, BLOCK: tl.constexpr,
            TILE: tl.constexpr):
    """Store the tile's values x (TILE,) fp32, zero beyond the tensor, into a moment: blockwise absmax (an integer
    max of |x|'s bit patterns: NaN wins, as torch's amax), x / absmax, the nearest code by the count table
    (table: (65536,) int32, base << 17 | the low 16 bits of the range's decision point), codes and scales
    written for every element of the tile's whole blocks."""
    if KIND == K_FP32:
        _store(data, offs, x, offs < n, False)
    elif KIND == K_BF16:
        _store(data, offs, x, offs < n, True)
    else:
        blocks = tl.reshape(x, (TILE // BLOCK, BLOCK))
        amax_bits = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        amax = amax_bits.to(tl.float32, bitcast=True)  # (TILE // BLOCK,)
        div = tl.where(amax != amax, amax, tl.maximum(amax, 1.17549435e-38))
        normed = tl.reshape(tl.div_rn(blocks, div[:, None]), (TILE,))
        y = normed + 0.0  # -0.0 -> +0.0
        bits = y.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        inside = offs < nblocks * BLOCK
        e = tl.load(table + (key >> 16) + 32768, mask=inside, other=0)
        code = (e >> 17) + ((key & 0xFFFF) >= (e & 0x1FFFF)).to(tl.int32)
        block0 = (offs // BLOCK)
        first = tl.reshape(block0, (TILE // BLOCK, BLOCK))
        tl.store(scale + tl.max(first, axis=1), amax, mask=tl.max(first, axis=1) < nblocks)
        if KIND == K_INT8:
            tl.store(data + offs, code.to(tl.uint8), mask=inside)
        else:
            pairs = tl.reshape(code, (TILE // 2, 2))
            weight = 16 - 15 * tl.arange(0, 2)  # (16, 1): the first code in the high half
            byte = tl.sum(pairs * weight[None, :], axis=1)
            boffs = tl.reshape(offs, (TILE // 2, 2))
            b0 = tl.min(boffs, axis=1) // 2
            tl.store(data + b0, byte.to(tl.uint8), mask=b0 * 2 < nblocks * BLOCK)


# the columns of a row of elementwise_step's tensor table
COL_P, COL_G, COL_M_DATA, COL_M_SCALE, COL_V_DATA, COL_V_SCALE, COL_COMP, COL_KEY0, COL_KEY1, COL_COUNTER = range(10)
COLUMNS = 10
A_FP32, A_INT16, A_UINT8 = 0, 1, 2  # what an address of the table points to


@triton.jit
def _address(row, col, POINTS_TO: tl.constexpr):
    """The pointer in column col of a table row (an int64 address), typed by POINTS_TO (A_*)."""
    a = tl.load(row + col)
    if POINTS_TO == A_FP32:
        return a.to(tl.pointer_type(tl.float32))
    elif POINTS_TO == A_INT16:
        return a.to(tl.pointer_type(tl.int16))
    else:
        return a.to(tl.pointer_type(tl.uint8))


@triton.jit
def _moment_address(row, col, KIND: tl.constexpr):
    """The address of a moment's data: fp32 values, bf16 ones as int16, or uint8 codes (K_INT8, K_INT4)."""
    if KIND == K_FP32:
        return _address(row, col, A_FP32)
    elif KIND == K_BF16:
        return _address(row, col, A_INT16)
    else:
        return _address(row, col, A_UINT8)


@triton.jit
def elementwise_step(tab, m_qmap, m_table, v_qmap, v_table, n, m_nblocks, v_nblocks, decay, alpha, w1, beta2, w2,
                     b2s, eps, momentum,
                     RULE: tl.constexpr, P_BF16: tl.constexpr, G_BF16: tl.constexpr, M_KIND: tl.constexpr,
                     V_KIND: tl.constexpr, M_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, HAS_DECAY: tl.constexpr,
                     EPS_BEFORE: tl.constexpr, DIRECTION: tl.constexpr, ROUNDING: tl.constexpr,
                     TILE: tl.constexpr):
    """The step of k tensors of n elements each, one program a (tile, tensor): grid (cdiv(n, TILE), k).

    tab: (k, COLUMNS) int64, a row a tensor: the addresses of its weight p (n,) (fp32, or bf16 as int16), its
    gradient g (the same), its moments' data and scales (m_*, v_*: v unused by Lion and SGDM, none read by the
    state-free rules 3, sign, and 4, sgd; a moment's data (n,) fp32 | (n,) bf16 as int16 | uint8 codes, its scale
    (nb,) fp32) and its compensation comp ((n,) bf16 as int16, W_KAHAN), then its weight stream's key words and
    the counter of its element 0 (W_STOCHASTIC); an address a setting does not read points to a placeholder.
    m_qmap, m_table, v_qmap, v_table: the block codecs' maps (2^bits,) fp32 and count tables (65536,) int32,
    shared by the k tensors. decay = 1 - lr wd; alpha = -lr / (1 - beta1^t) (AdamW), -lr free_scale (state-free)
    or -lr; w1 = 1 - beta1, w2 = 1 - beta2, b2s = sqrt(1 - beta2^t). DIRECTION: write the direction d into p
    (fp32) instead of stepping it. ROUNDING (bf16 weights): W_NEAREST, W_STOCHASTIC or W_KAHAN."""
    pid = tl.program_id(0)
    row = tab + tl.program_id(1).to(tl.int64) * COLUMNS
    if P_BF16 and not DIRECTION:
        p = _address(row, COL_P, A_INT16)
    else:
        p = _address(row, COL_P, A_FP32)
    if G_BF16:
        g = _address(row, COL_G, A_INT16)
    else:
        g = _address(row, COL_G, A_FP32)
    m_data = _moment_address(row, COL_M_DATA, M_KIND)
    m_scale = _address(row, COL_M_SCALE, A_FP32)
    v_data = _moment_address(row, COL_V_DATA, V_KIND)
    v_scale = _address(row, COL_V_SCALE, A_FP32)
    comp = _address(row, COL_COMP, A_INT16)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    grad = _load(g, offs, mask, G_BF16)
    if RULE < 3:
        m = _decode(m_data, m_scale, m_qmap, offs, mask, M_KIND, M_BLOCK)
    if RULE == 0:  # AdamW
        v = _decode(v_data, v_scale, v_qmap, offs, mask, V_KIND, V_BLOCK)
        m = _lerp(m, grad, w1)
        v = tl.fma(w2 * grad, grad, v * beta2)  # addcmul_: fma(value * t1, t2, self)
        if EPS_BEFORE:
            d = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v) + eps, b2s))
        else:
            d = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), b2s) + eps)
    elif RULE == 1:  # Lion
        d = _lerp(m, grad, w1)
        d = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        m = _lerp(m, grad, w2)
        v = m
    elif RULE == 2:  # SGD momentum
        m = m * momentum + grad
        d = m
        v = m
    elif RULE == 3:  # the state-free sign step (FRUGAL's residual, signSGD): torch.sign, 0 for NaN
        d = tl.where(grad > 0, 1.0, tl.where(grad < 0, -1.0, 0.0))
    else:  # the state-free SGD step
        d = grad
    if DIRECTION:  # p is an fp32 buffer for the direction (a projected step's subspace rule)
        tl.store(p + offs, d, mask=mask)
    elif ROUNDING == W_NEAREST:
        w = _load(p, offs, mask, P_BF16)
        if HAS_DECAY:
            w = w * decay
            if P_BF16:
                w = _round_bf16(w)
        _store(p, offs, tl.fma(d, alpha, w), mask, P_BF16)
    else:  # a bf16 weight's fp32 value (plus its compensation), decayed and updated in fp32, written once
        w = _load(p, offs, mask, True)
        if ROUNDING == W_KAHAN:
            w = w + _load(comp, offs, mask, True)
        if HAS_DECAY:
            w = w * decay
        y = tl.fma(d, alpha, w)
        if ROUNDING == W_KAHAN:
            new = _bf16_bits(y)
            tl.store(p + offs, new.to(tl.int16), mask=mask)
            _store(comp, offs, y - (new << 16).to(tl.float32, bitcast=True), mask, True)  # exact in fp32
        else:
            wkey0, wkey1, wcounter = tl.load(row + COL_KEY0), tl.load(row + COL_KEY1), tl.load(row + COL_COUNTER)
            tl.store(p + offs, _stochastic_bf16_bits(y, offs + wcounter, wkey0, wkey1).to(tl.int16), mask=mask)
    if RULE < 3:
        _encode(tl.where(mask, m, 0.0), m_data, m_scale, m_table, offs, n, m_nblocks, M_KIND, M_BLOCK, TILE)
    if RULE == 0:
        _encode(tl.where(mask, v, 0.0), v_data, v_scale, v_table, offs, n, v_nblocks, V_KIND, V_BLOCK, TILE)


@triton.jit
def column_best(g, hidden, out, m, n, CHUNK: tl.constexpr, HAS_HIDDEN: tl.constexpr, G_BF16: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """TACO's one-candidate search, rows [CHUNK * pid1, CHUNK * (pid1 + 1)) of columns [BLOCK_N * pid0, ...) of
    g (m, n) row-major (fp32 as int32, or bf16 as int16): the largest |g| of each column among the rows not hidden
    (hidden: (n,) int64, -1 for none), as the key (|g|'s bit pattern, every NaN the canonical one above +inf, -1
    for a hidden entry) << 32 | (2^32 - 1 - row), so that the largest key over all chunks is the largest |g| and,
    on ties, the smallest row (the first maximum, as torch's argmax). out: (chunks, n) int64."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    cols = pid0 * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    hid = tl.full((BLOCK_N,), -1, tl.int64)
    if HAS_HIDDEN:
        hid = tl.load(hidden + cols, mask=cmask, other=-1)
    best = tl.full((BLOCK_N,), -1, tl.int64) * 4294967296 - 1  # below every entry, hidden ones included
    r0 = pid1 * CHUNK
    for i in range(0, CHUNK):
        r = (r0 + i).to(tl.int64)
        rmask = cmask & ((tl.zeros_like(cols) + r) < m)  # a vector compare: a scalar mask confuses the interpreter
        if G_BF16:
            raw = tl.load(g + r * n + cols, mask=rmask, other=0).to(tl.int32) & 0xFFFF
            k = (raw << 16) & 0x7FFFFFFF
        else:
            k = tl.load(g + r * n + cols, mask=rmask, other=0) & 0x7FFFFFFF
        k = tl.where(k > 0x7F800000, 0x7FC00000, k).to(tl.int64)
        k = tl.where(hid == r, -1, k)
        key = k * 4294967296 + (4294967295 - r)
        best = tl.where(rmask & (key > best), key, best)
    tl.store(out + pid1.to(tl.int64) * n + cols, best, mask=cmask)
