"""The Triton kernel of ``triton_step.py`` (imported only where triton is installed).

One program of ``elementwise_step`` steps a tile of one of the tensors of a launch, which finds them in a table of
addresses (one launch steps every tensor of one size and one setting): TILE consecutive elements (whole codec
blocks), or a block of rows and columns where a factored v needs its row and column sums. ``moment_step`` stores
what the first pass left of a first moment (a ternary one, in tiles of five whole blocks of trits and their bytes);
``taco_columns`` and ``column_best`` are TACO's step. bf16 tensors are read as int16 and converted on their bit
patterns (exact, and round-to-nearest-even as c10::BFloat16 on the way back), so that the interpreter and the GPU
compute the same values. Shapes in the comments: n elements of a tensor, nb blocks of a moment.
"""

import triton
import triton.language as tl

from slimopt.optim.routes import abi


def _constants(count: int) -> list:
    """0 .. count - 1 as tl.constexpr: a compiled kernel reads no other module-level value (the interpreter does,
    so only a compile for a GPU shows the difference: tests/test_triton.py compiles the kernels for sm_90)."""
    return [tl.constexpr(i) for i in range(count)]


K_FP32, K_BF16, K_INT8, K_INT4, K_BF16_SR, K_TERNARY, K_FACTORED = _constants(7)  # a moment's storage
# the rules' ids (routes/abi.py): state-full ones below FIRST_FREE
R_ADAMW, R_LION, R_SGDM, R_NESTEROV = (tl.constexpr(abi.RULES[n]) for n in ("adamw", "lion", "sgdm", "nesterov"))
R_SIGN, R_SGD = tl.constexpr(abi.FREE_RULES["sign"]), tl.constexpr(abi.FREE_RULES["sgd"])
R_LIFT_SIGN = tl.constexpr(abi.LIFT_RULES["sign"])
FIRST_FREE = tl.constexpr(abi.FIRST_FREE_ID)
L_FLAT, L_ROWS = _constants(2)  # elementwise_step's layouts: consecutive elements, or rows x columns (a factored v)
S_ABSMAX, S_MEAN, S_RMS = _constants(3)  # a ternary moment's block scale
W_NEAREST, W_STOCHASTIC, W_KAHAN = _constants(3)  # how a bf16 weight is written (rules.rounded)
# fp32's smallest normal number, 2^-126 exactly (torch.finfo.tiny, the clamp of a zero block's scale): a literal a
# hair below it, as 1.17549435e-38, is an fp64 constant to triton 3.6, and fp64 operands fail tl.div_rn there
TINY = tl.constexpr(1.1754943508222875e-38)


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
def _hash(j, key0, key1):
    """The 32-bit hash (in int64) of counters j (int64) of the counter-based stream (key0, key1): noise.bits, its
    key32 from the scalar key words once per program."""
    key = _mix32(_mix32(tl.cast(key1, tl.int64) & 0xFFFFFFFF) ^ (tl.cast(key0, tl.int64) & 0xFFFFFFFF))
    return _mix32((j & 0xFFFFFFFF) ^ ((((j >> 32) & 0xFFFFFFFF) * 0x9E3779B9) & 0xFFFFFFFF) ^ key)


@triton.jit
def _int16(j, key0, key1):
    """CounterStream.int16 at counters j (int64): a half of hash(j // 2), the high one for an even j (in int64)."""
    h = _hash(j >> 1, key0, key1)
    return tl.where((j & 1) == 1, h & 0xFFFF, (h >> 16) & 0xFFFF)


@triton.jit
def _stochastic_bf16_bits(y, j, key0, key1):
    """quant.to_bf16(y, stochastic=True) with the counter-based stream (key0, key1) at counters j (int64): the 16-bit
    number of j added to the low half of y's pattern, truncated; inf and NaN rounded to nearest."""
    bits = y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    rounded = ((bits + _int16(j, key0, key1)) >> 16) & 0xFFFF
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded.to(tl.int32), _bf16_bits(y))


@triton.jit
def _uniform(j, key0, key1):
    """CounterStream.uniform at counters j: the 16-bit number times 2^-16 (fp32, exact)."""
    return _int16(j, key0, key1).to(tl.float32) * 1.52587890625e-05


@triton.jit
def _lerp(a, b, w):
    """torch's lerp: fma(w, b - a, a) for |w| < 0.5, else fma(w - 1, b - a, b)."""
    diff = b - a
    return tl.where(tl.abs(w) < 0.5, tl.fma(w, diff, a), tl.fma(w - 1.0, diff, b))


@triton.jit
def _digit(byte, d):
    """Digit d (0..4, the first weighted 1) of bytes of five base-3 digits (int32): quant.unpack_base3."""
    power = tl.where(d == 0, 1, tl.where(d == 1, 3, tl.where(d == 2, 9, tl.where(d == 3, 27, 81))))
    return (byte // power) % 3


@triton.jit
def _decode(data, scale, qmap, offs, mask, KIND: tl.constexpr, BLOCK: tl.constexpr, SCALE_BF16: tl.constexpr):
    """A moment's fp32 values at offs (any layout). data: (n,) fp32 | (n,) bf16 as int16 | (nb * BLOCK,) uint8
    codes | (nb * BLOCK / 2,) uint8 code pairs (first in the high half) | (ceil(nb * BLOCK / 5),) uint8 bytes of
    five trits (K_TERNARY: (digit - 1) times the block scale, TernaryCodec's decode); scale: (nb,) fp32, or bf16
    as int16 (SCALE_BF16); qmap: (2^bits,) fp32. Not K_FACTORED (``_decode_factored``)."""
    if KIND == K_FP32:
        x = _load(data, offs, mask, False)
    elif KIND == K_BF16 or KIND == K_BF16_SR:
        x = _load(data, offs, mask, True)
    elif KIND == K_TERNARY:
        byte = tl.load(data + offs // 5, mask=mask, other=0).to(tl.int32)
        s = _load(scale, offs // BLOCK, mask, SCALE_BF16)
        x = (_digit(byte, offs % 5) - 1).to(tl.float32) * s
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
def _decode_factored(row, col, denom, offs, mask, cols):
    """A factored second moment's values at offs of its (R, cols) matrix: row[r] * col[c] / denom, as
    codecs.FactoredCodec's outer(row, col) / mean(row) (denom: the mean, taken before the step)."""
    r = tl.load(row + offs // cols, mask=mask, other=0.0)
    c = tl.load(col + offs % cols, mask=mask, other=0.0)
    return tl.where(mask, tl.div_rn(r * c, denom), 0.0)


@triton.jit
def _nearest_code(x, table, mask):
    """The nearest map code of fp32 x through the count table (table: (65536,) int32, (base + 1) << 16 minus the
    low 16 bits of the range's decision point): quant.nearest_codes, NaN counted above every point."""
    y = x + 0.0  # -0.0 -> +0.0
    bits = y.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    e = tl.load(table + (key >> 16) + 32768, mask=mask, other=0)
    return (e + (key & 0xFFFF)) >> 16


@triton.jit
def _encode(x, data, scale, table, offs, n, nblocks, KIND: tl.constexpr, BLOCK: tl.constexpr,
            TILE: tl.constexpr):
    """Store the flat tile's values x (TILE,) fp32, zero beyond the tensor, into a moment: blockwise absmax (an
    integer max of |x|'s bit patterns: NaN wins, as torch's amax), x / absmax, the nearest code by the count
    table, codes and scales written for every element of the tile's whole blocks. K_INT8, K_INT4 only."""
    blocks = tl.reshape(x, (TILE // BLOCK, BLOCK))
    amax_bits = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    amax = amax_bits.to(tl.float32, bitcast=True)  # (TILE // BLOCK,)
    div = tl.where(amax != amax, amax, tl.maximum(amax, TINY))
    normed = tl.reshape(tl.div_rn(blocks, div[:, None]), (TILE,))
    inside = offs < nblocks * BLOCK
    code = _nearest_code(normed, table, inside)
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


@triton.jit
def _encode_dense(x, data, offs, mask, key0, key1, counter, KIND: tl.constexpr):
    """Store a moment kept element by element (fp32, bf16 to nearest, bf16 stochastically rounded from the
    moment's stream (key0, key1) at counter + element), any layout."""
    if KIND == K_FP32:
        _store(data, offs, x, mask, False)
    elif KIND == K_BF16:
        _store(data, offs, x, mask, True)
    else:
        tl.store(data + offs, _stochastic_bf16_bits(x, offs + counter, key0, key1).to(tl.int16), mask=mask)


@triton.jit
def _ternary_sr(x, u):
    """quant.stochastic_codes on the ternary map (-1, 0, 1): the bracketing pair (NaN above every point), up with
    probability x - lo (the spacing is 1), clamped to [0, 1]; codes 0, 1, 2 (int32)."""
    upper = ((x >= 0.0) | (x != x)).to(tl.int32)
    p_up = x - (upper.to(tl.float32) - 1.0)
    p_up = tl.where(p_up < 0.0, 0.0, p_up)  # NaN stays NaN and compares false
    p_up = tl.where(p_up > 1.0, 1.0, p_up)
    return upper + (u < p_up).to(tl.int32)


@triton.jit
def _encode_ternary(x, data, scale, err, table, offs, d, valid, pid, n, nblocks, key0, key1, counter,
                    BLOCK: tl.constexpr, SCALE_KIND: tl.constexpr, SCALE_BF16: tl.constexpr, EF: tl.constexpr):
    """TernaryCodec.encode of one tile of the byte layout: x (BLOCK, 8) fp32, element offs = 5 (BLOCK pid + i) + d
    (d: (1, 8), each slot's digit) for d < 5 (valid: d < 5 and inside the padded moment; x zero beyond the
    tensor), i.e. five whole blocks and BLOCK whole bytes. The block scale (absmax as an integer max; mean of |x| or rms in fp64, over the block's own
    values, as quant.block_absmean / block_rms; rounded to bf16 where stored so), x / scale, stochastic rounding
    with the moment's stream (ternary_sr*), or the nearest trit and twice the residual rounded stochastically
    to a trit (EF; x already holds the carried residual); bytes of five trits (digits beyond the padded moment 0)."""
    base = pid.to(tl.int64) * 5 * BLOCK
    blk = (offs - base) // BLOCK  # 0..4 on the valid slots
    lane = tl.arange(0, 8)
    scales = tl.zeros((8,), tl.float32)
    s_each = tl.zeros_like(x)
    for b in tl.static_range(5):
        sel = valid & (blk == b)
        if SCALE_KIND == S_ABSMAX:
            bits = tl.where(sel, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
            s = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        else:
            if SCALE_KIND == S_MEAN:
                terms = tl.abs(x)
            else:
                terms = x * x
            acc = tl.sum(tl.sum(tl.where(sel, terms, 0.0).to(tl.float64), axis=1), axis=0)
            count = tl.maximum(tl.minimum(n - (base + b * BLOCK), BLOCK), 1).to(tl.float64)
            if SCALE_KIND == S_MEAN:
                s = (acc / count).to(tl.float32)
            else:
                s = tl.sqrt(acc / count).to(tl.float32)  # fp64: correctly rounded (sqrt_rn is fp32 only)
        if SCALE_BF16:
            s = _round_bf16(s)
        scales = tl.where(lane == b, s, scales)
        s_each = tl.where(blk == b, s, s_each)
    block_index = pid.to(tl.int64) * 5 + lane
    in_blocks = (lane < 5) & (block_index < nblocks)
    if SCALE_BF16:
        tl.store(scale + block_index, _bf16_bits(scales).to(tl.int16), mask=in_blocks)
    else:
        tl.store(scale + block_index, scales, mask=in_blocks)
    div = tl.where(s_each != s_each, s_each, tl.maximum(s_each, TINY))
    normed = tl.div_rn(x, div)
    u = _uniform(offs + counter, key0, key1)
    power = tl.where(d == 0, 1, tl.where(d == 1, 3, tl.where(d == 2, 9, tl.where(d == 3, 27, 81))))
    nbytes = (nblocks * BLOCK + 4) // 5
    byte_index = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EF:
        trit = _nearest_code(normed, table, valid)
        resid = _ternary_sr((normed - (trit - 1).to(tl.float32)) * 2.0, u)
        tl.store(err + byte_index, tl.sum(tl.where(valid, resid * power, 0), axis=1).to(tl.uint8),
                 mask=byte_index < nbytes)
    else:
        trit = _ternary_sr(normed, u)
    tl.store(data + byte_index, tl.sum(tl.where(valid, trit * power, 0), axis=1).to(tl.uint8),
             mask=byte_index < nbytes)


# the columns of a row of elementwise_step's tensor table
(COL_P, COL_G, COL_M_DATA, COL_M_SCALE, COL_V_DATA, COL_V_SCALE, COL_COMP, COL_KEY0, COL_KEY1, COL_COUNTER,
 COL_M_ERR, COL_M_KEY0, COL_M_KEY1, COL_M_COUNTER, COL_V_KEY0, COL_V_KEY1, COL_V_COUNTER) = _constants(17)
COLUMNS = tl.constexpr(17)
A_FP32, A_INT16, A_UINT8, A_INT8, A_INT32, A_INT64 = _constants(6)  # what an address of a table points to


@triton.jit
def _address(row, col, POINTS_TO: tl.constexpr):
    """The pointer in column col of a table row (an int64 address), typed by POINTS_TO (A_*)."""
    a = tl.load(row + col)
    if POINTS_TO == A_FP32:
        return a.to(tl.pointer_type(tl.float32))
    elif POINTS_TO == A_INT16:
        return a.to(tl.pointer_type(tl.int16))
    elif POINTS_TO == A_UINT8:
        return a.to(tl.pointer_type(tl.uint8))
    elif POINTS_TO == A_INT8:
        return a.to(tl.pointer_type(tl.int8))
    elif POINTS_TO == A_INT32:
        return a.to(tl.pointer_type(tl.int32))
    else:
        return a.to(tl.pointer_type(tl.int64))


@triton.jit
def _moment_address(row, col, KIND: tl.constexpr):
    """The address of a moment's data: fp32 values (K_FACTORED: the row means), bf16 ones as int16, or uint8
    codes (K_INT8, K_INT4, K_TERNARY)."""
    if KIND == K_FP32 or KIND == K_FACTORED:
        return _address(row, col, A_FP32)
    elif KIND == K_BF16 or KIND == K_BF16_SR:
        return _address(row, col, A_INT16)
    else:
        return _address(row, col, A_UINT8)


@triton.jit
def _scale_address(row, col, BF16: tl.constexpr):
    """The address of fp32 values, or of bf16 ones as int16 (BF16): a moment's block scales (K_FACTORED: its
    column means), a gradient."""
    if BF16:
        return _address(row, col, A_INT16)
    else:
        return _address(row, col, A_FP32)


@triton.jit
def _tile(row, m_qmap, m_table, v_qmap, v_table, offs, mask, n, m_nblocks, v_nblocks, cols, denom,
          decay, alpha, w1, beta2, w2, b2s, eps, momentum,
          RULE: tl.constexpr, P_BF16: tl.constexpr, G_BF16: tl.constexpr, M_KIND: tl.constexpr,
          V_KIND: tl.constexpr, M_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, M_SCALE_BF16: tl.constexpr,
          HAS_DECAY: tl.constexpr, EPS_BEFORE: tl.constexpr, DIRECTION: tl.constexpr, ROUNDING: tl.constexpr,
          LAYOUT: tl.constexpr, DEFER_M: tl.constexpr, TILE: tl.constexpr):
    """The step of the elements at offs (mask: inside the tensor) of the tensor whose table row is `row`:
    decode, the rule, the weight's write, the moments kept element by element (and, in the flat layout, those
    of block codecs) stored; DEFER_M leaves the first moment to the moment pass. Returns the new v (fp32; m for
    the rules without one), which the rows layout sums into a factored moment's means."""
    if P_BF16 and not DIRECTION:
        p = _address(row, COL_P, A_INT16)
    else:
        p = _address(row, COL_P, A_FP32)
    g = _scale_address(row, COL_G, G_BF16)
    m_data = _moment_address(row, COL_M_DATA, M_KIND)
    m_scale = _scale_address(row, COL_M_SCALE, M_SCALE_BF16)
    v_data = _moment_address(row, COL_V_DATA, V_KIND)
    v_scale = _address(row, COL_V_SCALE, A_FP32)
    comp = _address(row, COL_COMP, A_INT16)
    grad = _load(g, offs, mask, G_BF16)
    if RULE < FIRST_FREE:
        m = _decode(m_data, m_scale, m_qmap, offs, mask, M_KIND, M_BLOCK, M_SCALE_BF16)
    if RULE == R_ADAMW:
        if V_KIND == K_FACTORED:
            v = _decode_factored(v_data, v_scale, denom, offs, mask, cols)
        else:
            v = _decode(v_data, v_scale, v_qmap, offs, mask, V_KIND, V_BLOCK, False)
        m = _lerp(m, grad, w1)
        v = tl.fma(w2 * grad, grad, v * beta2)  # addcmul_: fma(value * t1, t2, self)
        if EPS_BEFORE:
            d = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v) + eps, b2s))
        else:
            d = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), b2s) + eps)
    elif RULE == R_LION:
        d = _lerp(m, grad, w1)
        d = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        m = _lerp(m, grad, w2)
        v = m
    elif RULE == R_SGDM:
        m = m * momentum + grad
        d = m
        v = m
    elif RULE == R_NESTEROV:  # rules._nesterov: one momentum ahead, two roundings
        m = m * momentum + grad
        d = m * momentum + grad
        v = m
    elif RULE == R_SIGN:  # the state-free sign step (FRUGAL's residual, signSGD): torch.sign, 0 for NaN
        d = tl.where(grad > 0, 1.0, tl.where(grad < 0, -1.0, 0.0))
        v = d
    elif RULE == R_SGD:  # the state-free SGD step
        d = grad
        v = d
    else:  # R_LIFT_*: a projected step's write with FRUGAL's residual; grad is the lifted direction L, m_data the
        # gradient g (M_KIND: K_FP32 or K_BF16), v_data its part inside the subspace up (fp32): the direction
        # L.mul_(w1).add_(free_rule(-up + g), alpha=w2) as rules.apply_update forms it (sign, or the identity)
        r = -tl.load(v_data + offs, mask=mask, other=0.0) + _load(m_data, offs, mask, M_KIND == K_BF16)
        if RULE == R_LIFT_SIGN:
            r = tl.where(r > 0, 1.0, tl.where(r < 0, -1.0, 0.0))
        d = tl.fma(r, w2, grad * w1)
        v = d
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
    if RULE < FIRST_FREE and not DEFER_M:
        if M_KIND == K_INT8 or M_KIND == K_INT4:
            _encode(tl.where(mask, m, 0.0), m_data, m_scale, m_table, offs, n, m_nblocks, M_KIND, M_BLOCK, TILE)
        else:
            _encode_dense(m, m_data, offs, mask, tl.load(row + COL_M_KEY0), tl.load(row + COL_M_KEY1),
                          tl.load(row + COL_M_COUNTER), M_KIND)
    if RULE == R_ADAMW:
        if V_KIND == K_INT8 or V_KIND == K_INT4:
            _encode(tl.where(mask, v, 0.0), v_data, v_scale, v_table, offs, n, v_nblocks, V_KIND, V_BLOCK, TILE)
        elif V_KIND != K_FACTORED:
            _encode_dense(v, v_data, offs, mask, tl.load(row + COL_V_KEY0), tl.load(row + COL_V_KEY1),
                          tl.load(row + COL_V_COUNTER), V_KIND)
    return v


@triton.jit
def elementwise_step(tab, m_qmap, m_table, v_qmap, v_table, n, m_nblocks, v_nblocks, cols, denoms, row_sums,
                     col_sums, decay, alpha, w1, beta2, w2, b2s, eps, momentum,
                     RULE: tl.constexpr, P_BF16: tl.constexpr, G_BF16: tl.constexpr, M_KIND: tl.constexpr,
                     V_KIND: tl.constexpr, M_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, M_SCALE_BF16: tl.constexpr,
                     HAS_DECAY: tl.constexpr, EPS_BEFORE: tl.constexpr, DIRECTION: tl.constexpr,
                     ROUNDING: tl.constexpr, LAYOUT: tl.constexpr, DEFER_M: tl.constexpr, TILE: tl.constexpr,
                     RB: tl.constexpr, CB: tl.constexpr, ITERS: tl.constexpr):
    """The step of k tensors of n elements each: grid (tiles, k), one program a (tile, tensor).

    tab: (k, COLUMNS) int64, a row a tensor: the addresses of its weight p (n,) (fp32, or bf16 as int16), its
    gradient g (the same), its moments' data and scales (m_*, v_*: v unused by the one-moment rules, none read by
    the state-free rules R_SIGN and R_SGD; the write with a residual, R_LIFT_*, finds the gradient and its part
    inside the subspace in m's and v's data; a moment's data (n,) fp32 | (n,) bf16 as int16 | uint8 codes | fp32
    row means (R,) of a factored v, its scale (nb,) fp32 or bf16 | the factored v's column means (cols,)), its
    compensation comp ((n,) bf16 as int16, W_KAHAN), its weight stream's key words and the counter of its element
    0 (W_STOCHASTIC), a ternary m's residual trits (its EF form), and each moment's stream (key words, counter)
    where it rounds stochastically; an address a setting does not read points to a placeholder.
    m_qmap, m_table, v_qmap, v_table: the block codecs' maps (2^bits,) fp32 and count tables (65536,) int32,
    shared by the k tensors. decay = 1 - lr wd; alpha = -lr / (1 - beta1^t) (AdamW), -lr free_scale (state-free)
    or -lr; w1 = 1 - beta1, w2 = 1 - beta2, b2s = sqrt(1 - beta2^t) (the write with a residual: w1 the lifted
    direction's scale, w2 free_scale). DIRECTION: write the direction d into p (fp32) instead of stepping it.
    ROUNDING (bf16 weights): W_NEAREST, W_STOCHASTIC or W_KAHAN.

    LAYOUT L_FLAT: a program steps TILE consecutive elements (whole codec blocks). L_ROWS (a factored v of an
    (n / cols, cols) moment): a program steps RB x CB elements ITERS times down the rows, and writes the fp64 sums
    of the new v along each row of each tile into row_sums (k, cdiv(cols, CB), R) and its column sums over its
    RB ITERS rows into col_sums (k, cdiv(R, RB ITERS), cols); denoms (k,) fp32: each v's mean before the step.
    DEFER_M: the first moment is left to ``moment_step`` (a ternary one, or block codes in the rows layout)."""
    pid = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    row = tab + t * COLUMNS
    if LAYOUT == L_FLAT:
        offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        _tile(row, m_qmap, m_table, v_qmap, v_table, offs, offs < n, n, m_nblocks, v_nblocks, cols, 1.0, decay,
              alpha, w1, beta2, w2, b2s, eps, momentum, RULE, P_BF16, G_BF16, M_KIND, V_KIND, M_BLOCK, V_BLOCK,
              M_SCALE_BF16, HAS_DECAY, EPS_BEFORE, DIRECTION, ROUNDING, LAYOUT, DEFER_M, TILE)
    else:
        rows = n // cols
        col_tiles = (cols + CB - 1) // CB
        pr = pid // col_tiles
        pc = pid % col_tiles
        c = pc * CB + tl.arange(0, CB)
        denom = tl.load(denoms + t)
        col_acc = tl.zeros((CB,), tl.float64)
        for it in range(ITERS):
            r = (pr * ITERS + it) * RB + tl.arange(0, RB)
            offs = r[:, None].to(tl.int64) * cols + c[None, :]
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            v = _tile(row, m_qmap, m_table, v_qmap, v_table, offs, mask, n, m_nblocks, v_nblocks, cols, denom,
                      decay, alpha, w1, beta2, w2, b2s, eps, momentum, RULE, P_BF16, G_BF16, M_KIND, V_KIND,
                      M_BLOCK, V_BLOCK, M_SCALE_BF16, HAS_DECAY, EPS_BEFORE, DIRECTION, ROUNDING, LAYOUT, DEFER_M,
                      TILE)
            v64 = tl.where(mask, v, 0.0).to(tl.float64)
            tl.store(row_sums + (t * col_tiles + pc) * rows + r, tl.sum(v64, axis=1), mask=r < rows)
            col_acc += tl.sum(v64, axis=0)
        tl.store(col_sums + (t * ((rows + RB * ITERS - 1) // (RB * ITERS)) + pr) * cols + c, col_acc,
                 mask=c < cols)


@triton.jit
def moment_step(tab, m_qmap, m_table, n, m_nblocks, w1, w2, momentum,
                RULE: tl.constexpr, G_BF16: tl.constexpr, M_KIND: tl.constexpr, M_BLOCK: tl.constexpr,
                M_SCALE: tl.constexpr, M_SCALE_BF16: tl.constexpr, M_EF: tl.constexpr, TILE: tl.constexpr):
    """The first moment's update and store that ``elementwise_step`` left (DEFER_M), after it: m decoded again,
    m' = the rule's update of m by g (the same arithmetic, so the same m' the direction used), stored. A ternary
    m in the byte layout (a program: M_BLOCK bytes, five blocks, and their residual trits under M_EF), int8 or
    int4 codes in the flat one (TILE elements). grid (tiles, k); tab as elementwise_step's."""
    pid = tl.program_id(0)
    row = tab + tl.program_id(1).to(tl.int64) * COLUMNS
    g = _scale_address(row, COL_G, G_BF16)
    m_data = _moment_address(row, COL_M_DATA, M_KIND)
    m_scale = _scale_address(row, COL_M_SCALE, M_SCALE_BF16)
    if M_KIND == K_TERNARY:
        i = tl.arange(0, M_BLOCK)[:, None]
        d = tl.arange(0, 8)[None, :]
        offs = pid.to(tl.int64) * 5 * M_BLOCK + 5 * i + d
        mask = (d < 5) & (offs < n)
        valid = (d < 5) & (offs < m_nblocks * M_BLOCK)
    else:
        offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        mask = offs < n
    grad = _load(g, offs, mask, G_BF16)
    m = _decode(m_data, m_scale, m_qmap, offs, mask, M_KIND, M_BLOCK, M_SCALE_BF16)
    if RULE == R_ADAMW:
        m = _lerp(m, grad, w1)
    elif RULE == R_LION:
        m = _lerp(m, grad, w2)
    else:  # SGD momentum, heavy-ball or Nesterov: the same buffer
        m = m * momentum + grad
    m = tl.where(mask, m, 0.0)
    if M_KIND == K_TERNARY:
        err = _address(row, COL_M_ERR, A_UINT8)
        if M_EF:  # the carried residual, ((digit - 1) * 0.5) * the old scale, added to the tensor's elements
            byte = tl.load(err + offs // 5, mask=mask, other=0).to(tl.int32)
            s = _load(m_scale, offs // M_BLOCK, mask, M_SCALE_BF16)
            m = m + tl.where(mask, ((_digit(byte, offs % 5) - 1).to(tl.float32) * 0.5) * s, 0.0)
        _encode_ternary(m, m_data, m_scale, err, m_table, offs, d, valid, pid, n, m_nblocks, tl.load(row + COL_M_KEY0),
                        tl.load(row + COL_M_KEY1), tl.load(row + COL_M_COUNTER), M_BLOCK, M_SCALE, M_SCALE_BF16,
                        M_EF)
    else:
        _encode(m, m_data, m_scale, m_table, offs, n, m_nblocks, M_KIND, M_BLOCK, TILE)


# TACO's table: a row a weight of one shape, the addresses of its gradient g (m, n) row-major (fp32, or bf16 as
# int16), its weight p (m, n) (likewise), its stored component's codes (n,) (float8_e4m3fn codes as uint8, or int8),
# their scales (n,) (fp32, or bf16 as int16) and rows (n,) (uint8, int16, int32 or int64: ROWS, an A_*)
T_G, T_P, T_CODES, T_ABSMAX, T_ROWS = _constants(5)
TACO_COLUMNS = tl.constexpr(5)


@triton.jit
def column_best(tab, hidden, out, m, n, chunks, CHUNK: tl.constexpr, HAS_HIDDEN: tl.constexpr,
                G_BF16: tl.constexpr, BLOCK_N: tl.constexpr):
    """TACO's one-candidate search, rows [CHUNK * pid1, CHUNK * (pid1 + 1)) of columns [BLOCK_N * pid0, ...) of
    the gradient of weight t = pid2 of the table (tab: (k, TACO_COLUMNS) int64, only T_G read): the largest |g|
    of each column among the rows not hidden (hidden: (k, n) int64, -1 for none), as the key (|g|'s bit pattern,
    every NaN the canonical one above +inf, -1 for a hidden entry) << 32 | (2^32 - 1 - row), so that the largest
    key over all chunks is the largest |g| and, on ties, the smallest row (the first maximum, as torch's argmax).
    out: (k, chunks, n) int64. Grid (cdiv(n, BLOCK_N), chunks, k)."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    if G_BF16:
        g = _address(tab + t * TACO_COLUMNS, T_G, A_INT16)
    else:
        g = _address(tab + t * TACO_COLUMNS, T_G, A_INT32)
    cols = pid0 * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    hid = tl.full((BLOCK_N,), -1, tl.int64)
    if HAS_HIDDEN:
        hid = tl.load(hidden + t * n + cols, mask=cmask, other=-1)
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
    tl.store(out + (t * chunks + pid1) * n + cols, best, mask=cmask)


@triton.jit
def _taco_stored(codes, absmax, rows, fp8_values, g, cols, mask, n, top, beta, w, FP8: tl.constexpr,
                 SCALE_BF16: tl.constexpr, G_BF16: tl.constexpr):
    """Steps 1-2 of TACO's update at one component a column, for columns `cols`: the stored component decoded
    (code * (scale / top)) and, where live (non-zero), its EMA with the gradient at its row,
    fma(g, 1 - beta, v beta), as the C kernel's taco_one. Returns (stored row int64, live, value fp32)."""
    if FP8:
        code = tl.load(fp8_values + tl.load(codes + cols, mask=mask, other=0).to(tl.int32), mask=mask, other=0.0)
    else:
        code = tl.load(codes + cols, mask=mask, other=0).to(tl.float32)
    v = code * tl.div_rn(_load(absmax, cols, mask, SCALE_BF16), top)
    r = tl.load(rows + cols, mask=mask, other=0).to(tl.int64)
    live = mask & (v != 0.0)
    gr = _load(g, r * n + cols, live, G_BF16)
    return r, live, tl.where(live, tl.fma(gr, w, v * beta), 0.0)


@triton.jit
def _rint(x):
    """x rounded to the nearest integer, ties to even (C's nearbyintf), for |x| < 2^22: adding and taking away
    1.5 * 2^23 leaves no fraction bits (libdevice.rint has no interpreter form)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _fp8_e4m3fn(x):
    """fp32 x, |x| <= 448 and not NaN -> float8_e4m3fn codes (int32), round to nearest even: normal values keep
    3 mantissa bits, rounded on the integer pattern; below 2^-6 the code counts 2^-9 steps (the C kernel's)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    small = _rint(tl.abs(x) * 512.0).to(tl.int32)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    return sign | tl.where(a < (121 << 23), small, normal)


@triton.jit
def taco_columns(tab, fp8_values, hidden, keys, n, chunks, top, beta, w, alpha, KEEP: tl.constexpr,
                 FP8: tl.constexpr, SCALE_BF16: tl.constexpr, G_BF16: tl.constexpr, P_BF16: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """TACO's per-column work at taco_k 1 (taco.sparse_update then apply_sparse's entries, nearest rounding),
    BLOCK_N columns of weight t = pid1 of the table a program: grid (cdiv(n, BLOCK_N), k).

    tab: (k, TACO_COLUMNS) int64 (T_*); fp8_values (256,) fp32: the values of float8_e4m3fn codes (FP8).
    KEEP False: hidden (k, n) int64 <- the stored row of each live column, else -1 (what ``column_best`` leaves out).
    KEEP True, after ``column_best`` wrote keys (k, chunks, n) int64 and the weight was decayed: the best candidate
    (the largest key over the chunks; a NaN |g| is no valid candidate), its value (1 - beta) g, the larger |value|
    of stored and candidate kept (the stored one on ties, a NaN candidate over a stored number), its sign the
    direction, the kept component stored (|value| the scale, rounded as stored; value / scale * top as a code),
    and p[row, c] moved by alpha sign (alpha = -lr c) in fp32, rounded once."""
    t = tl.program_id(1).to(tl.int64)
    row = tab + t * TACO_COLUMNS
    g = _scale_address(row, T_G, G_BF16)
    p = _scale_address(row, T_P, P_BF16)
    absmax = _scale_address(row, T_ABSMAX, SCALE_BF16)
    rows = _address(row, T_ROWS, ROWS)
    if FP8:
        codes = _address(row, T_CODES, A_UINT8)
    else:
        codes = _address(row, T_CODES, A_INT8)
    hidden = hidden + t * n
    keys = keys + t * chunks * n
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n
    r, live, stored = _taco_stored(codes, absmax, rows, fp8_values, g, cols, mask, n, top, beta, w, FP8,
                                   SCALE_BF16, G_BF16)
    if not KEEP:
        tl.store(hidden + cols, tl.where(live, r, -1), mask=mask)
    else:
        best = tl.full((BLOCK_N,), -1, tl.int64) * 4294967296 - 1
        for ch in range(0, chunks):
            best = tl.maximum(best, tl.load(keys + ch * n + cols, mask=mask, other=-1))
        key = best >> 32
        cand = 4294967295 - (best & 4294967295)
        valid = mask & (key >= 0) & (key <= 0x7F800000)
        cv = tl.where(valid, _load(g, cand * n + cols, valid, G_BF16) * w, 0.0)
        sa = tl.abs(stored)
        ca = tl.abs(cv)
        take = (ca > sa) | ((ca != ca) & (sa == sa))
        kept_row = tl.where(take, cand, r)
        v = tl.where(take, cv, stored)
        sign = tl.where(v > 0, 1.0, tl.where(v < 0, -1.0, 0.0))  # torch.sign: 0 for NaN
        scale = tl.abs(v)
        if SCALE_BF16:
            sbits = _bf16_bits(scale)
            tl.store(absmax + cols, sbits.to(tl.int16), mask=mask)
            scale = (sbits << 16).to(tl.float32, bitcast=True)
        else:
            tl.store(absmax + cols, scale, mask=mask)
        normed = tl.where(scale > 0.0, tl.div_rn(v, tl.maximum(scale, TINY)), 0.0)
        normed = tl.minimum(tl.maximum(normed, -1.0), 1.0) * top
        if FP8:
            tl.store(codes + cols, _fp8_e4m3fn(normed).to(tl.uint8), mask=mask)
        else:
            tl.store(codes + cols, _rint(normed).to(tl.int8), mask=mask)
        tl.store(rows + cols, kept_row.to(rows.dtype.element_ty), mask=mask)
        at = kept_row * n + cols
        _store(p, at, tl.fma(sign, alpha, _load(p, at, mask, P_BF16)), mask, P_BF16)
