/* AdamW's one-pass step fused for AVX-512: every moment codec (8-bit and 4-bit block codes, ternary, factored,
 * fp32, bf16), sixteen elements a register.
 *
 * Included by elementwise_step.c after its types and helpers, whose arithmetic it repeats operation for operation
 * (tests/test_native_fused.py holds the two to the same bits). A run of about 2048 elements at a time:
 *   1. per 16 elements: the gradient, both moments decoded, AdamW's update of m and v, the direction, the weight's
 *      decay and move, written; the new moments kept in buffers (a loop compiled for each common codec pair);
 *   2. per codec: every block's scale first (blocks then do not wait on one another's reductions), then the values
 *      divided by it and coded (256 codes: a gather from the range table, or on AMD a line per binade and one
 *      look-up, nearest8_avx512.h; 16 codes: a search in registers; stochastic trits from the counter's hash) and
 *      packed; a factored moment's sums tile by tile, as there.
 * The divider is the unit this step and torch's fused AdamW both wait on (torch: two divisions and a square root an
 * element). Here a division by a value many elements share (the bias correction's sqrt(1 - beta2^t), a block's
 * scale, a factored moment's denominator) is a product with the correctly rounded reciprocal and one fma
 * correction, which is the correctly rounded quotient (Markstein's theorem; Muller et al., Handbook of
 * Floating-Point Arithmetic, section 4.9) wherever quotient, remainder and reciprocal are normal numbers; elements
 * outside that range take the divider. Measured: docs/benchmarks.md, "The host step at a LLaMA-7B layer's shapes".
 */

#ifdef __AVX512F__

#define TINY_NORMAL 1.17549435e-38f
#define SAFE_LOW 0x1p-100f  /* operands from which the reciprocal's remainder stays a normal number */
#define SAFE_HIGH 0x1p100f

/* (16,) bf16 or fp32 at p[i..i+16) as fp32 */
static inline __m512 load16(const void *p, int32_t dtype, int64_t i) {
    if (dtype == D_FP32) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* f32_to_bf16 of sixteen values: round to nearest even on the bit pattern, every NaN to 0x7FC0. The AVX-512 BF16
 * conversion rounds alike but for subnormals (flushed to zero) and NaN (its sign and payload kept): it takes the
 * registers that hold neither. */
static inline __m256i to_bf16_16(__m512 x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (!_mm512_fpclass_ps_mask(x, 0xA1)) return (__m256i)_mm512_cvtneps_pbh(x);  /* 0xA1: NaN, subnormal */
#endif
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* a / b for a vector a and a scalar b with y = 1.0f / b (b within [SAFE_LOW, SAFE_HIGH]): the correctly rounded
 * quotient where low <= |a| <= SAFE_HIGH (low = max(SAFE_LOW, b 2^-100): the quotient and the remainder are
 * normal numbers), by the divider in the rare register where a nonzero element lies outside (NaN and inf too).
 * Zeros give +0. */
static inline __m512 div_by_scalar(__m512 a, __m512 bv, __m512 yv, __m512 low) {
    const __m512 q = _mm512_mul_ps(a, yv);
    const __m512 r = _mm512_fnmadd_ps(q, bv, a);  /* exact: a - q b */
    const __m512 q2 = _mm512_fmadd_ps(r, yv, q);
    const __m512 mag = _mm512_abs_ps(a);
    const __mmask16 ok = _mm512_cmp_ps_mask(mag, low, _CMP_GE_OQ)
                         & _mm512_cmp_ps_mask(mag, _mm512_set1_ps(SAFE_HIGH), _CMP_LE_OQ);
    const __mmask16 slow = (__mmask16)(~ok & _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ));
    return slow ? _mm512_mask_div_ps(q2, slow, a, bv) : q2;
}

/* How a block's values are divided by its scale */
enum { BY_RECIPROCAL = 0, BY_RECIPROCAL_CHECKED = 1, BY_DIVISION = 2 };

static inline __m512 normalize16(int how, __m512 x, __m512 dv, __m512 yv, __m512 low) {
    if (how == BY_RECIPROCAL) {  /* every nonzero |x| of the block >= low: no element needs the divider */
        const __m512 q = _mm512_mul_ps(x, yv);
        return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, dv, x), yv, q);
    }
    return how == BY_RECIPROCAL_CHECKED ? div_by_scalar(x, dv, yv, low) : _mm512_div_ps(x, dv);
}

/* sqrt(v) / b2s (+ eps before or after, as the rule's placement) for 16 values, bit for bit the scalar loop's */
static inline __m512 adamw_denom(__m512 v, __m512 b2s, __m512 y, __m512 eps, int eps_before) {
    __m512 s = _mm512_sqrt_ps(v);
    if (eps_before) s = _mm512_add_ps(s, eps);
    /* s is 0, or >= sqrt of the smallest subnormal (2^-74.5): the remainder of s / b2s (b2s in (0, 1]) is normal */
    const __m512 q = _mm512_mul_ps(s, y);
    const __m512 q2 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, b2s, s), y, q);
    /* inf and NaN: q itself (inf * y = inf); the correction would make NaN of inf */
    const __mmask16 special = _mm512_cmp_ps_mask(_mm512_abs_ps(s), _mm512_set1_ps(3.40282347e38f), _CMP_NLE_UQ);
    const __m512 quot = special ? _mm512_mask_mov_ps(q2, special, q) : q2;
    return eps_before ? quot : _mm512_add_ps(quot, eps);
}

/* Element e + j of a base-3 packed array, for e = 5 q + phase: digit d = (phase + j) % 5 of byte q + (phase + j) / 5,
 * which is floor(byte / 3^d) mod 3: floor(byte / 3^d) = ((byte + TRIT_ADD) * TRIT_MAGIC) >> 16, TRIT_MAGIC =
 * ceil(2^16 / 3^d) and TRIT_ADD = 0 for d > 0 (exact for every byte: the product's excess stays below 3^-d), 65535
 * and 1 for d = 0 (b + 1 - (b + 1) / 2^16 floors to b), so that every factor fits 16 bits; the mod by the same rule
 * for d = 1. Arithmetic, not a table: a gather is slow on AMD's Zen 4 (docs/benchmarks.md, "On AMD Zen 4"). */
static int32_t TRIT_BYTE[5][16], TRIT_MAGIC[5][16], TRIT_ADD[5][16];

static void init_trit_lanes(void) {
    static const int32_t magic[5] = {65535, 21846, 7282, 2428, 810};
    for (int p = 0; p < 5; p++)
        for (int j = 0; j < 16; j++) {
            TRIT_BYTE[p][j] = (p + j) / 5;
            TRIT_MAGIC[p][j] = magic[(p + j) % 5];
            TRIT_ADD[p][j] = (p + j) % 5 == 0;
        }
}

/* (16,) trits - 1 as fp32: -1, 0 or 1, of bytes b (int32, 0..255) at the digits of phase p */
static inline __m512 trits16(__m512i b, int64_t p) {
    b = _mm512_add_epi32(b, _mm512_loadu_si512(TRIT_ADD[p]));
    const __m512i magic = _mm512_loadu_si512(TRIT_MAGIC[p]);
#ifdef __AVX512BW__  /* every factor in a lane's low 16 bits, its high 16 zero: the high half of 16-bit products */
    const __m512i q = _mm512_mulhi_epu16(b, magic);
    const __m512i third = _mm512_mulhi_epu16(q, _mm512_set1_epi32(21846));
    const __m512i digit = _mm512_sub_epi32(q, _mm512_mullo_epi16(third, _mm512_set1_epi32(3)));
#else
    const __m512i q = _mm512_srli_epi32(_mm512_mullo_epi32(b, magic), 16);
    const __m512i third = _mm512_srli_epi32(_mm512_mullo_epi32(q, _mm512_set1_epi32(21846)), 16);
    const __m512i digit = _mm512_sub_epi32(q, _mm512_add_epi32(third, _mm512_slli_epi32(third, 1)));
#endif
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(digit, _mm512_set1_epi32(1)));
}

/* map256_t and the 8-bit search: map256_avx512.h and nearest8_avx512.h, included by elementwise_step.c */

/* A moment's decoded values along a tile, sixteen elements at a time from a start element (a multiple of 16):
 * decode() of every codec, with the position in blocks, bytes of trits or rows of a factored moment carried from
 * one register to the next instead of divided out */
typedef struct {
    const codec_t *c;
    __m512 tab16;                     /* C_BLOCK4: the map */
    const float *pre;                 /* C_BLOCK8 with VBMI: pre[e] the map value of element e's code (map256_decode) */
    int64_t block, left;              /* block and ternary codecs: the current block, registers left in it */
    __m512 scale;                     /* its scale */
    int64_t byte, phase;              /* ternary codecs: element = 5 byte + phase */
    int64_t row, col;                 /* C_FACTORED: the position in the (rows, cols) moment */
    __m512 rowv, dn, y, low;          /* row mean; denominator, its reciprocal and the checked quotients' bound */
    int by_reciprocal, row_fast;      /* the reciprocal; unchecked for the current row */
    float col_min, col_max;           /* the smallest nonzero and the largest column mean (col_bounds) */
} reader16_t;

static inline void reader16_start(reader16_t *r, const codec_t *c, int64_t e, const float *col_bounds) {
    memset(r, 0, sizeof *r);
    r->c = c;
    if (c->kind == C_BLOCK4) r->tab16 = _mm512_loadu_ps(c->qmap);
    if (c->kind == C_BLOCK8 || c->kind == C_BLOCK4 || c->kind == C_TERNARY_SR || c->kind == C_TERNARY_EF) {
        r->block = e / c->block;
        r->left = c->block / 16;
        r->scale = _mm512_set1_ps(scale_at(c, r->block));
    }
    r->byte = e / 5;
    r->phase = e % 5;
    if (c->kind == C_FACTORED) {
        r->row = e / c->cols;
        r->col = e % c->cols;
        r->rowv = _mm512_set1_ps(c->row[r->row]);
        const float dn = c->denom;
        r->by_reciprocal = dn >= SAFE_LOW && dn <= SAFE_HIGH;
        r->dn = _mm512_set1_ps(dn);
        r->y = _mm512_set1_ps(r->by_reciprocal ? 1.0f / dn : 0.0f);
        r->low = _mm512_set1_ps(dn * 0x1p-100f > SAFE_LOW ? dn * 0x1p-100f : SAFE_LOW);
        r->row_fast = -1;  /* not known before the first register */
        r->col_min = col_bounds[0];
        r->col_max = col_bounds[1];
    }
}

static inline void next_block16(reader16_t *r) {
    if (--r->left > 0) return;
    r->block++;
    r->left = r->c->block / 16;
    r->scale = _mm512_set1_ps(scale_at(r->c, r->block));
}

/* the 16 values of elements [e, e + 16), e the element after the last call's (or the start). phase: -1, or for a
 * ternary codec the register's place (0-4) in a run of five registers (80 elements, 16 bytes) from r->byte, a
 * constant in an unrolled loop that moves r->byte on by 16 after the five (its tables then need no index) */
static inline __attribute__((always_inline)) __m512 reader16_next(reader16_t *r, int64_t e, const int kind,
                                                                  const int phase) {
    const codec_t *c = r->c;
    switch (kind >= 0 ? kind : c->kind) {  /* a constant kind: the caller's specialized loop */
    case C_BLOCK8: {  /* the run's map values, decoded before the loop; without VBMI a gather from the map */
#ifdef __AVX512VBMI__
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(r->pre + e), r->scale);
#else
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)c->data + e)));
        const __m512 x = _mm512_mul_ps(_mm512_i32gather_ps(code, c->qmap, 4), r->scale);
#endif
        next_block16(r);
        return x;
    }
    case C_BLOCK4: {  /* 8 bytes, the first code of a byte in its high half; the map in one register */
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)c->data + e / 2)));
        const __m512i pairs = _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), bytes);
        const __m512i shift = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(pairs, shift), _mm512_set1_epi32(15));
        const __m512 x = _mm512_mul_ps(_mm512_permutexvar_ps(code, r->tab16), r->scale);
        next_block16(r);
        return x;
    }
    case C_TERNARY_SR:
    case C_TERNARY_EF: {  /* ternary_values: digit - 1 times the block's scale */
        const int64_t p = phase >= 0 ? phase : r->phase;
        const int64_t byte = phase >= 0 ? r->byte + 3 * phase : r->byte;  /* 16 p = 5 (3 p) + p for p < 5 */
        /* the bytes these elements lie in: (p + 15) / 5 + 1 = 4 for every phase p < 5 (masked: the codes may end) */
        const __m512i four = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0xF, (const uint8_t *)c->data + byte));
        const __m512i b = _mm512_permutexvar_epi32(_mm512_loadu_si512(TRIT_BYTE[p]), four);
        const __m512 x = _mm512_mul_ps(trits16(b, p), r->scale);
        if (phase < 0) {
            r->byte += 3 + (p == 4);  /* 16 = 3 x 5 + 1 */
            r->phase = p == 4 ? 0 : p + 1;
        }
        next_block16(r);
        return x;
    }
    case C_FACTORED: {  /* (row * col) / denom; a register lies in one row (cols a multiple of 16) */
        if (r->col == 0 || r->row_fast < 0) {  /* a row's first register (or the reader's): its old mean */
            const float rv = c->row[r->row], low = _mm512_cvtss_f32(r->low);
            r->rowv = _mm512_set1_ps(rv);
            /* every product of the row a zero or, with room for its rounding, within the reciprocal's range */
            r->row_fast = r->by_reciprocal && (rv == 0.0f || (rv * r->col_min >= 2.0f * low
                                                              && rv * r->col_max <= 0.5f * SAFE_HIGH));
        }
        const __m512 prod = _mm512_mul_ps(r->rowv, _mm512_loadu_ps(c->col + r->col));
        const __m512 x = r->row_fast ? normalize16(BY_RECIPROCAL, prod, r->dn, r->y, r->low)
                         : r->by_reciprocal ? div_by_scalar(prod, r->dn, r->y, r->low) : _mm512_div_ps(prod, r->dn);
        r->col += 16;
        if (r->col == c->cols) {
            r->col = 0;
            r->row++;
        }
        return x;
    }
    default:
        return load16(c->data, c->kind == C_FP32 ? D_FP32 : D_BF16, e);
    }
}

/* the moments' codec pairs whose loop is compiled for them (ADAMW16_SPECIALIZED), the others' through a switch */
#define ADAMW16_PAIRS(X) X(C_BLOCK8, C_BLOCK8) X(C_BLOCK4, C_BLOCK4) X(C_TERNARY_SR, C_FACTORED) X(C_FP32, C_FP32)

/* count(points <= x) of 16 normalized values on a 256-code map: the range table's gather (count_le_many's) */
static inline __m512i codes16_table(const codec_t *c, __m512 x, int signed_zero_possible) {
    if (signed_zero_possible) x = _mm512_add_ps(x, _mm512_setzero_ps());  /* -0 -> +0 */
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i key = _mm512_xor_si512(bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31),
                                                                 _mm512_set1_epi32(0x7FFFFFFF)));
    /* the table's range index is (key >> 16) + 32768: the offset is in the base address */
    const __m512i e = _mm512_i32gather_epi32(_mm512_srai_epi32(key, 16), c->nearest.packed + 32768, 4);
    return _mm512_srli_epi32(_mm512_add_epi32(e, _mm512_and_si512(key, _mm512_set1_epi32(0xFFFF))), 16);
}

/* The same count for at most 15 points: a binary search in registers (count_le_compare's), round r comparing with
 * round[r][count], the points shifted so that no index needs an addition; NaN: as count_le_compare */
typedef struct {
    __m512 round[4];
    int32_t rounds, n_points;
} search16_t;

static void search16_init(search16_t *t, const count_table_t *table) {
    const int32_t np = table->n_points;
    int32_t half = 1;
    while (2 * half - 1 < np) half *= 2;
    t->rounds = 0;
    t->n_points = np;
    for (int32_t step = half; step >= 1; step /= 2) {
        float shifted[16];
        for (int k = 0; k < 16; k++) shifted[k] = k + step - 1 < np ? table->points[k + step - 1] : NAN;
        t->round[t->rounds++] = _mm512_loadu_ps(shifted);
    }
}

/* The counts of four registers, their rounds interleaved: four chains in flight instead of one (measured faster) */
static inline __attribute__((always_inline)) void codes64_search(const search16_t *t, const __m512 x[4],
                                                                 int nan_possible, __m512i count[4]) {
    for (int q = 0; q < 4; q++) count[q] = _mm512_setzero_si512();
    for (int32_t r = 0, step = 1 << (t->rounds - 1); r < t->rounds; r++, step /= 2)
        for (int q = 0; q < 4; q++)
            count[q] = _mm512_mask_add_epi32(count[q], _mm512_cmp_ps_mask(x[q], _mm512_permutexvar_ps(count[q], t->round[r]),
                                                                          _CMP_GE_OQ), count[q], _mm512_set1_epi32(step));
    if (!nan_possible) return;
    for (int q = 0; q < 4; q++) {
        const __mmask16 high_nan = _mm512_cmpgt_epi32_mask(_mm512_castps_si512(x[q]), _mm512_set1_epi32(0x7F800000));
        count[q] = _mm512_mask_mov_epi32(count[q], high_nan, _mm512_set1_epi32(t->n_points));
    }
}

/* A block of B values (a multiple of 16) divided by its scale: how (normalize16's), the divisor (the scale clamped
 * to the smallest normal), its reciprocal and the smallest magnitude the reciprocal takes unchecked */
typedef struct {
    int how;
    float div, recip, low;
} block_div_t;

/* Per block of B values (a multiple of 16), nb (a constant, at most 4) consecutive blocks in one loop: |x| as int32
 * patterns order like the floats (NaN above inf), so per lane *top is their max (the absmax) and *low the unsigned
 * min of pattern - 1 (the smallest nonzero magnitude less one; a zero wraps to the largest); and where sums (1: |x|,
 * 2: x * x rounded to fp32) block_sum's eight fp64 chains, lane j the sum of elements j, j + 8, ... (sum8 combines
 * them in block_sum's order). The blocks' chains advance together instead of each waiting on its own last addition.
 * reduce16 finishes top and low sixteen blocks at a time. */
static inline __attribute__((always_inline)) void block_stats(const float *x, int64_t B, int sums, const int nb,
                                                              __m512i *top, __m512i *low, __m512d *acc) {
    __m512i max_bits[4], min_bits[4];
    __m512d a[4];
    for (int q = 0; q < nb; q++) {
        max_bits[q] = _mm512_setzero_si512();
        min_bits[q] = _mm512_set1_epi32(-1);
        a[q] = _mm512_setzero_pd();
    }
    for (int64_t i = 0; i < B; i += 16)
        for (int q = 0; q < nb; q++) {
            const __m512 v = _mm512_loadu_ps(x + q * B + i);
            const __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
            max_bits[q] = _mm512_max_epi32(max_bits[q], bits);
            min_bits[q] = _mm512_min_epu32(min_bits[q], _mm512_sub_epi32(bits, _mm512_set1_epi32(1)));
            if (!sums) continue;
            const __m512 t = sums == 2 ? _mm512_mul_ps(v, v) : _mm512_castsi512_ps(bits);
            const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
            a[q] = _mm512_add_pd(a[q], _mm512_cvtps_pd(_mm512_castps512_ps256(t)));  /* elements i .. i + 7 */
            a[q] = _mm512_add_pd(a[q], _mm512_cvtps_pd(high));                      /* then i + 8 .. i + 15 */
        }
    for (int q = 0; q < nb; q++) {
        top[q] = max_bits[q];
        low[q] = min_bits[q];
        if (sums) acc[q] = a[q];
    }
}

/* block_stats' top and low of one block (the int8 writer's rows too) */
static inline void block_magnitudes(const float *x, int64_t B, __m512i *top, __m512i *low) {
    block_stats(x, B, 0, 1, top, low, NULL);
}

/* The max (or the unsigned min) of each of sixteen registers' lanes, lane j of the result for register j: four
 * rounds, each halving the lanes per register and pairing the registers, instead of a reduction per register.
 * half[round]: the lanes each pair's two permutes pick (0-15 the first register's, 16-31 the second's) */
static inline __m512i reduce16(__m512i *r, int min) {
    static const int32_t half[4][2][16] = {
        {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
        {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
         {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
        {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
         {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
        {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
         {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};
    for (int round = 0, n = 16; round < 4; round++, n /= 2) {
        const __m512i lo = _mm512_loadu_si512(half[round][0]), hi = _mm512_loadu_si512(half[round][1]);
        for (int j = 0; j < n / 2; j++) {
            const __m512i a = _mm512_permutex2var_epi32(r[2 * j], lo, r[2 * j + 1]);
            const __m512i b = _mm512_permutex2var_epi32(r[2 * j], hi, r[2 * j + 1]);
            r[j] = min ? _mm512_min_epu32(a, b) : _mm512_max_epi32(a, b);
        }
    }
    return r[0];
}

/* ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) of each of eight registers a, lane j of the result for register
 * j: the same additions in the same order, three rounds over the registers together */
static inline __m512d sum8(const __m512d *a) {
    __m512d s[4], t[2];
    for (int j = 0; j < 4; j++)  /* a0 + a1, b0 + b1, a2 + a3, b2 + b3, ... of the pair (a, b) */
        s[j] = _mm512_add_pd(_mm512_unpacklo_pd(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_pd(a[2 * j], a[2 * j + 1]));
    /* (x0 + x1) + (x2 + x3) of the four registers x, then (x4 + x5) + (x6 + x7) of the four */
    const __m512i lo2 = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi2 = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int j = 0; j < 2; j++)
        t[j] = _mm512_add_pd(_mm512_permutex2var_pd(s[2 * j], lo2, s[2 * j + 1]),
                             _mm512_permutex2var_pd(s[2 * j], hi2, s[2 * j + 1]));
    const __m512i lo3 = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), hi3 = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    return _mm512_add_pd(_mm512_permutex2var_pd(t[0], lo3, t[1]), _mm512_permutex2var_pd(t[0], hi3, t[1]));
}

/* scale: what the codec stored; top, low: the block's reduced block_magnitudes. The reciprocal where the divisor
 * and every magnitude lie in its range (unchecked where the smallest nonzero one allows: quotients from 2^-100 on),
 * else the divider. */
static inline block_div_t block_divisor(float scale, int32_t top, uint32_t low) {
    block_div_t d;
    d.div = scale != scale ? scale : scale > TINY_NORMAL ? scale : TINY_NORMAL;
    d.low = d.div * 0x1p-100f > SAFE_LOW ? d.div * 0x1p-100f : SAFE_LOW;
    uint32_t low_bits, high_bits;
    const float high = SAFE_HIGH;
    memcpy(&low_bits, &d.low, 4);
    memcpy(&high_bits, &high, 4);
    d.how = !(d.div >= SAFE_LOW && d.div <= SAFE_HIGH) || (uint32_t)top > high_bits ? BY_DIVISION
            : low >= low_bits - 1 ? BY_RECIPROCAL : BY_RECIPROCAL_CHECKED;
    d.recip = d.how != BY_DIVISION ? 1.0f / d.div : 0.0f;
    return d;
}

/* Every block's scale (absmax, or the mean or root mean square of |x| over its cnt real values, as encode), stored,
 * and its divisor into divs. Sixteen blocks at a time: their reductions finished together (reduce16, sum8), the
 * means' divisions and square roots eight blocks a register, so that no block waits on the one before it. */
static void block_divisors(codec_t *c, int64_t off, int64_t cnt, const float *x, block_div_t *divs) {
    const int64_t B = c->block, blocks = (cnt + B - 1) / B;
    const int sums = c->scale_kind != S_ABSMAX, terms = sums ? 1 + (c->scale_kind == S_RMS) : 0;
    int32_t top[MAX_TILE / 16 + 16];
    uint32_t low[MAX_TILE / 16 + 16];
    float scale[MAX_TILE / 16 + 16];
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
        __m512i tops[16], lows[16];
        __m512d acc[16];
        for (int64_t j = 0; j < 16; j++) {
            if (j % 4 == 0 && b0 + j + 4 <= blocks) {  /* four whole blocks together */
                block_stats(x + (b0 + j) * B, B, terms, 4, &tops[j], &lows[j], &acc[j]);
                j += 3;
            } else if (b0 + j < blocks) {
                block_stats(x + (b0 + j) * B, B, terms, 1, &tops[j], &lows[j], &acc[j]);
            } else {  /* lanes past the last block */
                tops[j] = _mm512_setzero_si512();
                lows[j] = _mm512_set1_epi32(-1);
                acc[j] = _mm512_setzero_pd();
            }
        }
        _mm512_storeu_si512(top + b0, reduce16(tops, 0));
        _mm512_storeu_si512(low + b0, reduce16(lows, 1));
        if (!sums) continue;
        for (int64_t h = 0; h < 16; h += 8) {  /* (float)(acc / k) or (float)sqrt(acc / k), k the real values */
            double k[8];
            for (int j = 0; j < 8; j++) {
                const int64_t left = cnt - (b0 + h + j) * B;
                k[j] = (double)(left < B ? (left > 0 ? left : 1) : B);
            }
            /* eight whole blocks of a power-of-two size: the product with 1 / B is the quotient, exactly (a sum of
             * |x| or x * x in fp64 is far from the range's ends), and does not wait on the slow fp64 divider */
            const int whole = (B & (B - 1)) == 0 && cnt - (b0 + h + 7) * B >= B;
            __m512d q = whole ? _mm512_mul_pd(sum8(acc + h), _mm512_set1_pd(1.0 / (double)B))
                              : _mm512_div_pd(sum8(acc + h), _mm512_loadu_pd(k));
            if (c->scale_kind == S_RMS) q = _mm512_sqrt_pd(q);
            _mm256_storeu_ps(scale + b0 + h, _mm512_cvtpd_ps(q));
        }
    }
    if (!sums) memcpy(scale, top, 4 * (size_t)blocks);
    for (int64_t b = 0; b < blocks; b++) divs[b] = block_divisor(store_scale(c, off / B + b, scale[b]), top[b], low[b]);
}

/* encode() of a block codec, vectorized: x holds cnt values (padded here with zeros to whole blocks) */
static void encode_blocks16(codec_t *c, int64_t off, int64_t cnt, float *x) {
    const int64_t B = c->block, padded = (cnt + B - 1) / B * B;
    for (int64_t i = cnt; i < padded; i++) x[i] = 0.0f;
    search16_t search;
    memset(&search, 0, sizeof search);
    if (c->kind == C_BLOCK4) search16_init(&search, &c->nearest);
    block_div_t divs[MAX_TILE / 16];
    block_divisors(c, off, cnt, x, divs);
#ifdef __AVX512VBMI__
    const nearest8_t *fit = c->kind == C_BLOCK8 ? nearest8_for(&c->nearest, padded) : NULL;
    if (fit != NULL) {  /* the values normalized in place (measured faster than in the search's registers), then
                         * their codes without a gather */
        for (int64_t b0 = 0; b0 < padded; b0 += B) {
            const block_div_t *d = &divs[b0 / B];
            const __m512 dv = _mm512_set1_ps(d->div), yv = _mm512_set1_ps(d->recip), lowv = _mm512_set1_ps(d->low);
            for (int64_t i = b0; i < b0 + B; i += 16)
                _mm512_storeu_ps(x + i, normalize16(d->how, _mm512_loadu_ps(x + i), dv, yv, lowv));
        }
        nearest8_codes(fit, x, padded, (uint8_t *)c->data + off);
        return;
    }
#endif
    for (int64_t b0 = 0; b0 < padded; b0 += B) {
        const block_div_t *d = &divs[b0 / B];
        const int how = d->how;
        const __m512 dv = _mm512_set1_ps(d->div), yv = _mm512_set1_ps(d->recip), lowv = _mm512_set1_ps(d->low);
        if (c->kind == C_BLOCK8) {
            for (int64_t i = b0; i < b0 + B; i += 16) {
                /* the unchecked reciprocal gives +0 for a zero and normal numbers for the rest: no -0 to normalize */
                const __m512i code = codes16_table(c, normalize16(how, _mm512_loadu_ps(x + i), dv, yv, lowv), how != BY_RECIPROCAL);
                _mm_storeu_si128((__m128i *)((uint8_t *)c->data + off + i), _mm512_cvtepi32_epi8(code));
            }
            continue;
        }
        /* C_BLOCK4, 64 at a time: two codes a byte, the first in the high half */
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        const int nan_possible = how == BY_DIVISION;
        for (int64_t i = b0; i < b0 + B; i += 64) {  /* four searches, their rounds interleaved */
            __m512 v[4];
            __m512i code[4];
            for (int q = 0; q < 4; q++) v[q] = normalize16(how, _mm512_loadu_ps(x + i + 16 * q), dv, yv, lowv);
            codes64_search(&search, v, nan_possible, code);
            for (int h = 0; h < 2; h++) {
                const __m512i a = code[2 * h], z = code[2 * h + 1];
                const __m512i hi = _mm512_permutex2var_epi32(a, even, z), lo = _mm512_permutex2var_epi32(a, odd, z);
                _mm_storeu_si128((__m128i *)((uint8_t *)c->data + (off + i) / 2 + 16 * h),
                                 _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_slli_epi32(hi, 4), lo)));
            }
        }
    }
}

/* mix32 (noise._mix32_) of sixteen words */
static inline __m512i mix32_16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int32_t)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* uniform_many's numbers of counters [j0, j0 + 32), j0 even, under the stream key k (stream_key), as two
 * registers from the sixteen hashes of j0 / 2 on (the high halves for the even counters, the low ones for the odd),
 * or 0 where their high words differ (the caller's cue to take uniform_many) */
static inline int uniform32(uint32_t k, int64_t j0, __m512 *u0, __m512 *u1) {
    const uint64_t c = (uint64_t)j0 >> 1;
    if ((uint32_t)c > 0xFFFFFFFFu - 15u) return 0;
    const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(uint32_t)c),
                                        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const uint32_t key = (uint32_t)(c >> 32) * STREAM_PHI ^ k;  /* stream_hash's: the high word and the key */
    const __m512i h = mix32_16(_mm512_xor_si512(lo, _mm512_set1_epi32((int32_t)key)));
    const __m512i high = _mm512_srli_epi32(h, 16), low = _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF));
    /* counter 2 l + b: hash l's high half (b = 0, index l) or low half (b = 1, index 16 + l) */
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512 unit = _mm512_set1_ps(0x1p-16f);
    *u0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(high, first, low)), unit);
    *u1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(high, second, low)), unit);
    return 1;
}


/* pack_trits of digits held one a byte, 80 (16 bytes) at a time where the processor permutes bytes: the k-th of
 * every five picked by one permute, and the byte formed by Horner's rule (((d4 3 + d3) 3 + d2) 3 + d1) 3 + d0,
 * each product by 3 as two additions (no partial sum exceeds 242); the rest one by one as pack_trits */
static void pack_trit_bytes(const uint8_t *digits, int64_t n, uint8_t *bytes) {
    int64_t j = 0;
#ifdef __AVX512VBMI__
    __m512i pick[5];
    for (int d = 0; d < 5; d++) {
        uint8_t idx[64];
        for (int k = 0; k < 64; k++) idx[k] = (uint8_t)(k < 16 ? 5 * k + d : 0);
        pick[d] = _mm512_loadu_si512(idx);
    }
    for (; j + 80 <= n; j += 80) {
        const __m512i lo = _mm512_loadu_si512(digits + j);
        const __m512i hi = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(digits + j + 64)));
        __m128i t = _mm512_castsi512_si128(_mm512_permutex2var_epi8(lo, pick[4], hi));
        for (int d = 3; d >= 0; d--)
            t = _mm_add_epi8(_mm_add_epi8(_mm_add_epi8(t, t), t),
                             _mm512_castsi512_si128(_mm512_permutex2var_epi8(lo, pick[d], hi)));
        _mm_storeu_si128((__m128i *)(bytes + j / 5), t);
    }
#endif
    for (; j < n; j += 5) {  /* a last partial byte: the missing digits 0, as pack_trits */
        int32_t byte = 0;
        for (int64_t k = j; k < j + 5 && k < n; k++) byte += digits[k] * POW3[k - j];
        bytes[j / 5] = (uint8_t)byte;
    }
}

/* encode() of C_TERNARY_SR, vectorized: x holds cnt values (padded here with zeros to whole blocks); off a
 * multiple of the block and of 5. Every block's scale first (the blocks' sums, square roots and divisions then do
 * not wait on one another), then the values divided by it (the reciprocal, unchecked where the block's magnitudes
 * allow it), the stochastic trit of each from its counter's number, packed five a byte. */
static void encode_ternary_sr16(codec_t *c, int64_t off, int64_t cnt, float *x) {
    const int64_t B = c->block, padded = (cnt + B - 1) / B * B;
    for (int64_t i = cnt; i < padded; i++) x[i] = 0.0f;
    uint8_t code[MAX_TILE];
    block_div_t divs[MAX_TILE / 16];
    block_divisors(c, off, cnt, x, divs);
    const __m512i one = _mm512_set1_epi32(1);
    const uint32_t key = stream_key(c->key0, c->key1);
    __m512 next = _mm512_setzero_ps();  /* the numbers of the next register, drawn with this one's (uniform32) */
    int have_next = 0;
    for (int64_t b0 = 0; b0 < padded; b0 += B) {
        const block_div_t *d = &divs[b0 / B];
        const int how = d->how;
        const __m512 dv = _mm512_set1_ps(d->div), yv = _mm512_set1_ps(d->recip), lowv = _mm512_set1_ps(d->low);
        for (int64_t i = b0; i < b0 + B; i += 16) {
            /* a quotient's sign decides nothing at zero: -0 and +0 give the same trit */
            const __m512 q = normalize16(how, _mm512_loadu_ps(x + i), dv, yv, lowv);
            __m512 u;
            const int64_t j = c->counter + off + i;
            if (have_next) {  /* the second register of the last call's pair (within this block) */
                u = next;
                have_next = 0;
            } else if (i + 32 <= b0 + B && !(j & 1) && uniform32(key, j, &u, &next)) {
                have_next = 1;
            } else {
                float tmp[16];
                uniform_many(c->key0, c->key1, j, tmp, 16);
                u = _mm512_loadu_ps(tmp);
            }
            /* ternary_sr_many: the bracket (0, 1) where q >= 0 or NaN, else (-1, 0); p_up = q - (upper - 1) */
            const __mmask16 upper = _mm512_cmp_ps_mask(q, _mm512_setzero_ps(), _CMP_NLT_UQ);  /* not q < 0 */
            /* q - (-1) is q + 1 exactly, and q - 0 is q (-0 stays -0): one masked addition */
            __m512 p = _mm512_mask_add_ps(q, (__mmask16)~upper, q, _mm512_set1_ps(1.0f));
            /* clamped to [0, 1]; a NaN p (of a NaN q) becomes 0, which rounds the same (u < p false either way) */
            p = _mm512_min_ps(_mm512_max_ps(p, _mm512_setzero_ps()), _mm512_set1_ps(1.0f));
            const __m512i up = _mm512_maskz_mov_epi32(upper, one);
            const __m512i digit = _mm512_mask_add_epi32(up, _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ), up, one);
            _mm_storeu_si128((__m128i *)(code + i), _mm512_cvtepi32_epi8(digit));
        }
    }
    pack_trit_bytes(code, padded, (uint8_t *)c->data + off / 5);
}

/* Whether the fused path takes this step: AdamW writing a weight (to nearest if bf16) with two moments whose codecs
 * it reads sixteen at a time (block and ternary codecs with blocks of whole registers, factored moments with rows
 * of whole registers, fp32, bf16) */
static int adamw16_applies(const step_t *s) {
    if (s->rule != RULE_ADAMW || s->direction_only || s->n_codecs != 2) return 0;
    if (!(s->bias2_sqrt >= 0x1p-60f && s->bias2_sqrt <= 0x1p60f)) return 0;  /* adamw_denom's reciprocal */
    if (s->param_dtype == D_BF16 && s->rounding != W_NEAREST) return 0;
    for (int k = 0; k < 2; k++) {
        const codec_t *c = &s->codecs[k];
        switch (c->kind) {
        case C_BLOCK8:  /* encode_blocks16's codes, 32 (4-bit: 64) at a time */
            if (c->qmap_n != 256 || c->nearest.packed == NULL || c->scale_kind != S_ABSMAX || c->block % 32) return 0;
            break;
        case C_BLOCK4:
            if (c->qmap_n != 16 || c->nearest.n_points > 15 || c->scale_kind != S_ABSMAX || c->block % 64) return 0;
            break;
        case C_TERNARY_SR:
        case C_TERNARY_EF:
            if (c->block % 16) return 0;
            break;
        case C_FACTORED:
            if (c->cols % 16) return 0;
            break;
        case C_FP32:
        case C_BF16:
            break;
        default:  /* a codec reader16_next does not know: the tile-by-tile step */
            return 0;
        }
    }
    return 1;
}

/* the 8-bit moments' maps as byte planes (map256_t), built once per range */
typedef struct {
#ifdef __AVX512VBMI__
    map256_t map[2];
#else
    int unused;
#endif
} adamw16_maps_t;

/* AdamW's per-step values in registers */
typedef struct {
    __m512 w1, w2, beta2, eps, b2s, yb, alpha, decay, w1_hi;
    int lerp_low, eps_before, has_decay;
} adamw16_t;

static inline adamw16_t adamw16_constants(const step_t *s) {
    adamw16_t k;
    k.w1 = _mm512_set1_ps(s->w1);
    k.w2 = _mm512_set1_ps(s->w2);
    k.beta2 = _mm512_set1_ps(s->beta2);
    k.eps = _mm512_set1_ps(s->eps);
    k.b2s = _mm512_set1_ps(s->bias2_sqrt);
    k.yb = _mm512_set1_ps(1.0f / s->bias2_sqrt);
    k.alpha = _mm512_set1_ps(s->alpha);
    k.decay = _mm512_set1_ps(s->decay);
    k.w1_hi = _mm512_set1_ps(s->w1 - 1.0f);
    k.lerp_low = fabsf(s->w1) < 0.5f;
    k.eps_before = s->eps_before;
    k.has_decay = s->has_decay;
    return k;
}

/* AdamW on elements [e, e + 16): the moments read, updated (into *m, *v), the weight decayed and moved */
static inline __attribute__((always_inline)) void adamw16_vec(const step_t *s, const adamw16_t *k, reader16_t *rm,
                                                              reader16_t *rv, int64_t e, __m512 *m, __m512 *v,
                                                              const int km, const int kv, const int32_t grad_dtype,
                                                              const int32_t param_dtype, const int mphase) {
    const __m512 g = load16(s->grad, grad_dtype, e);
    __m512 mv = reader16_next(rm, e, km, mphase), vv = reader16_next(rv, e, kv, -1);
    const __m512 diff = _mm512_sub_ps(g, mv);  /* lerp(m, g, w1) as torch's vectorized lerp */
    mv = k->lerp_low ? _mm512_fmadd_ps(k->w1, diff, mv) : _mm512_fmadd_ps(k->w1_hi, diff, g);
    vv = _mm512_fmadd_ps(_mm512_mul_ps(k->w2, g), g, _mm512_mul_ps(vv, k->beta2));
    const __m512 d = _mm512_div_ps(mv, adamw_denom(vv, k->b2s, k->yb, k->eps, k->eps_before));
    *m = mv;
    *v = vv;
    if (param_dtype == D_FP32) {
        float *p = (float *)s->param + e;
        __m512 w = _mm512_loadu_ps(p);
        if (k->has_decay) w = _mm512_mul_ps(w, k->decay);
        _mm512_storeu_ps(p, _mm512_fmadd_ps(d, k->alpha, w));
    } else {
        uint16_t *p = (uint16_t *)s->param + e;
        __m512 w = load16(p, D_BF16, 0);
        if (k->has_decay)  /* rounded to bf16 (p.mul_) before the update */
            w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(_mm512_mul_ps(w, k->decay))), 16));
        _mm256_storeu_si256((__m256i *)p, to_bf16_16(_mm512_fmadd_ps(d, k->alpha, w)));
    }
}

static inline void prefetch_bytes(const void *p, int64_t lo, int64_t hi, int write) {
    for (int64_t b = lo & ~(int64_t)63; b < hi; b += 64)
        if (write) __builtin_prefetch((const char *)p + b, 1, 3);
        else __builtin_prefetch((const char *)p + b, 0, 3);
}

/* The lines of elements [e, e + n) of the weight, the gradient and the moments' stored data, asked for ahead: a
 * run's streams are read in one loop, then its moments are encoded touching none of them, so the processor's
 * prefetcher sees each stream stop and the next run would wait on its first loads; asked for here while this run
 * is read (measured in docs/benchmarks.md). Past the window's end it asks for lines nobody reads (a prefetch never
 * faults). */
static inline __attribute__((always_inline)) void prefetch_elements(const step_t *s, int64_t e, int64_t n) {
    const int wsize = s->param_dtype == D_FP32 ? 4 : 2, gsize = s->grad_dtype == D_FP32 ? 4 : 2;
    prefetch_bytes(s->param, e * wsize, (e + n) * wsize, 1);
    prefetch_bytes(s->grad, e * gsize, (e + n) * gsize, 0);
    for (int k = 0; k < s->n_codecs; k++) {  /* the bytes of elements [e, e + n) as each codec stores them */
        const codec_t *c = &s->codecs[k];
        switch (c->kind) {
        case C_FP32: prefetch_bytes(c->data, 4 * e, 4 * (e + n), 1); break;
        case C_BF16: prefetch_bytes(c->data, 2 * e, 2 * (e + n), 1); break;
        case C_BLOCK8: prefetch_bytes(c->data, e, e + n, 0); break;
        case C_BLOCK4: prefetch_bytes(c->data, e / 2, (e + n + 1) / 2, 0); break;
        case C_TERNARY_SR: case C_TERNARY_EF: prefetch_bytes(c->data, e / 5, (e + n + 4) / 5, 0); break;
        default: break;  /* a factored moment's rows and columns: a few values, read from cache */
        }
    }
}

/* step_range's AdamW over [t0, t0 + cnt), cnt a multiple of 16, on the fused path: the new moments into m and v.
 * km, kv, grad_dtype, param_dtype: constants in each specialized copy (adamw16_tile), so that the loop branches on
 * none of them; km, kv -1: the codecs' kinds read at run time */
static inline __attribute__((always_inline)) void adamw16_loop(const step_t *s, int64_t t0, int64_t cnt, float *m,
                                                               float *v, const float (*bounds)[2],
                                                               const adamw16_maps_t *maps, const int km,
                                                               const int kv, const int32_t grad_dtype,
                                                               const int32_t param_dtype) {
    const adamw16_t k = adamw16_constants(s);
    reader16_t rm, rv;
    reader16_start(&rm, &s->codecs[0], t0, bounds[0]);
    reader16_start(&rv, &s->codecs[1], t0, bounds[1]);
    const int m8 = (km >= 0 ? km : s->codecs[0].kind) == C_BLOCK8, v8 = (kv >= 0 ? kv : s->codecs[1].kind) == C_BLOCK8;
#ifdef __AVX512VBMI__
    /* an 8-bit moment's map values into its own buffer, 64 at a time just before the loop reads them (the decode's
     * permutes then overlap the update's divisions): element i is read there before its new value is written */
    if (m8) rm.pre = m - t0;
    if (v8) rv.pre = v - t0;
#else
    (void)maps;
#endif
    /* an fp32 moment is written in place (each element read before it is written), the others into the buffers */
    float *mout = (km >= 0 ? km : s->codecs[0].kind) == C_FP32 ? (float *)s->codecs[0].data + t0 : m;
    float *vout = (kv >= 0 ? kv : s->codecs[1].kind) == C_FP32 ? (float *)s->codecs[1].data + t0 : v;
    const int64_t chunk = m8 || v8 ? 64 : 80;  /* 8-bit codes decoded 64 at a time; ternary bytes 16 (80 codes) */
    for (int64_t i0 = 0; i0 < cnt; i0 += chunk) {
        const int64_t end = cnt - i0 < chunk ? cnt : i0 + chunk;
#ifdef __AVX512VBMI__
        if (m8) map256_decode(&maps->map[0], (const uint8_t *)s->codecs[0].data + t0 + i0, end - i0, m + i0);
        if (v8) map256_decode(&maps->map[1], (const uint8_t *)s->codecs[1].data + t0 + i0, end - i0, v + i0);
#endif
        prefetch_elements(s, t0 + cnt + i0, end - i0);  /* the same place in the next run */
        int64_t i = i0;
        if (km == C_TERNARY_SR && rm.phase == 0)  /* five registers a turn, each with its constant phase */
            for (; i + 80 <= end; i += 80) {
#define ADAMW16_PHASE(p)                                                                                      \
                {                                                                                             \
                    __m512 mv, vv;                                                                            \
                    adamw16_vec(s, &k, &rm, &rv, t0 + i + 16 * (p), &mv, &vv, km, kv, grad_dtype, param_dtype, (p)); \
                    _mm512_storeu_ps(mout + i + 16 * (p), mv);                                                \
                    _mm512_storeu_ps(vout + i + 16 * (p), vv);                                                \
                }
                ADAMW16_PHASE(0) ADAMW16_PHASE(1) ADAMW16_PHASE(2) ADAMW16_PHASE(3) ADAMW16_PHASE(4)
#undef ADAMW16_PHASE
                rm.byte += 16;
            }
        for (; i < end; i += 16) {
            __m512 mv, vv;
            adamw16_vec(s, &k, &rm, &rv, t0 + i, &mv, &vv, km, kv, grad_dtype, param_dtype, -1);
            _mm512_storeu_ps(mout + i, mv);
            _mm512_storeu_ps(vout + i, vv);
        }
    }
}

#define ADAMW16_DTYPES(km, kv)                                                                              \
    if (s->codecs[0].kind == (km) && s->codecs[1].kind == (kv)) {                                          \
        if (s->grad_dtype == D_BF16 && s->param_dtype == D_BF16) adamw16_loop(s, t0, cnt, m, v, bounds, maps, km, kv, D_BF16, D_BF16); \
        else if (s->grad_dtype == D_BF16) adamw16_loop(s, t0, cnt, m, v, bounds, maps, km, kv, D_BF16, D_FP32);          \
        else if (s->param_dtype == D_BF16) adamw16_loop(s, t0, cnt, m, v, bounds, maps, km, kv, D_FP32, D_BF16);         \
        else adamw16_loop(s, t0, cnt, m, v, bounds, maps, km, kv, D_FP32, D_FP32);                                       \
        return;                                                                                            \
    }

static void adamw16_tile(const step_t *s, int64_t t0, int64_t cnt, float *m, float *v, const float (*bounds)[2],
                         const adamw16_maps_t *maps) {
    ADAMW16_PAIRS(ADAMW16_DTYPES)
    adamw16_loop(s, t0, cnt, m, v, bounds, maps, -1, -1, s->grad_dtype, s->param_dtype);
}

/* The fused path over [lo, hi) (lo a multiple of tile) in runs of whole tiles of about 2048 elements (fewer set-ups
 * than tile by tile): each run read and updated (adamw16_tile), then its moments encoded, a block codec's over the
 * whole run (its blocks carry nothing from one to the next), any other codec's tile by tile as step_range does (a
 * factored moment's sums grouped as there). A factored moment's row means are read by the run's decode before its
 * encode writes a completed row's new mean, as tile by tile. m and v: (MAX_TILE,) buffers. Returns where the
 * general loop takes over: hi, or the start of a last run whose length is not a multiple of 16. */
static int64_t adamw16_range(step_t *s, int64_t tile, int64_t lo, int64_t hi, float *m, float *v) {
    const int64_t run = tile * (2048 / tile > 1 ? 2048 / tile : 1);
    float *moments[2] = {m, v};
    float bounds[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  /* a factored moment's smallest nonzero and largest column mean */
    for (int k = 0; k < 2; k++) {
        const codec_t *c = &s->codecs[k];
        if (c->kind != C_FACTORED) continue;
        uint32_t lo_bits = 0xFFFFFFFFu, hi_bits = 0;  /* as patterns: NaN above inf; a zero wraps past the largest */
        for (int64_t j = 0; j < c->cols; j++) {
            uint32_t u;
            memcpy(&u, &c->col[j], 4);
            u &= 0x7FFFFFFFu;
            lo_bits = u - 1 < lo_bits ? u - 1 : lo_bits;
            hi_bits = u > hi_bits ? u : hi_bits;
        }
        lo_bits = lo_bits == 0xFFFFFFFFu ? 0x7F800000u : lo_bits + 1;  /* no nonzero mean: inf */
        memcpy(&bounds[k][0], &lo_bits, 4);
        memcpy(&bounds[k][1], &hi_bits, 4);
    }
    adamw16_maps_t maps;
#ifdef __AVX512VBMI__
    for (int k = 0; k < 2; k++)
        if (s->codecs[k].kind == C_BLOCK8) map256_init(&maps.map[k], s->codecs[k].qmap);
#endif
    for (int64_t t0 = lo; t0 < hi; t0 += run) {
        const int64_t cnt = hi - t0 < run ? hi - t0 : run;
        if (cnt % 16 != 0) return t0;
        adamw16_tile(s, t0, cnt, m, v, (const float (*)[2])bounds, &maps);
        for (int k = 0; k < 2; k++) {
            codec_t *c = &s->codecs[k];
            if (c->kind == C_BLOCK8 || c->kind == C_BLOCK4) {
                encode_blocks16(c, t0, cnt, moments[k]);
                continue;
            }
            if (c->kind == C_FP32) continue;  /* written in place by the loop */
            if (c->kind == C_TERNARY_SR) {  /* nothing carried between blocks; t0 a multiple of 5 (whole bytes) */
                encode_ternary_sr16(c, t0, cnt, moments[k]);
                continue;
            }
            for (int64_t u0 = t0; u0 < t0 + cnt; u0 += tile)
                encode(c, u0, t0 + cnt - u0 < tile ? t0 + cnt - u0 : tile, moments[k] + (u0 - t0));
        }
    }
    return hi;
}

#endif /* __AVX512F__ */
