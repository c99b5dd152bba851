/* AdamW on block-coded moments (8-bit and 4-bit codes, absmax block scales), fused for AVX-512.
 *
 * Included by elementwise_step.c after its types and helpers; the same arithmetic as its step_range and encode,
 * sixteen elements a register, so that a tile is read and written once with no pass over a buffer but the
 * encode's (which needs the block's absmax before it can code the block):
 *   1. per 16 elements: the gradient, both moments decoded (map look-up times the block's scale), AdamW's update of
 *      m and v, the direction, the weight's decay and move, written; the new m and v kept in the tile's buffers;
 *   2. per codec and block: the absmax, the scale stored, every value divided by it and coded (a gather from the
 *      range table for 256 codes, a search in registers for 16), the codes packed and stored.
 * What keeps it near memory speed is the divider, the one unit both steps contend for: torch's fused AdamW divides
 * twice and takes a square root per element; here the divisions by a value shared by many elements (the bias
 * correction's sqrt(1 - beta2^t), a block's scale) are a multiplication by the correctly rounded reciprocal and
 * one fma correction, which gives the correctly rounded quotient (Markstein's theorem; Muller et al., Handbook of
 * Floating-Point Arithmetic, section 4.9) wherever the quotient, the remainder and the reciprocal are normal
 * numbers; the few elements outside that range take the division.
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
 * quotient where |a| >= low (low = max(SAFE_LOW, b 2^-100): the quotient and the remainder are normal numbers),
 * by the divider in the rare register where some nonzero element lies below. Zeros give +0. */
static inline __m512 div_by_scalar(__m512 a, __m512 bv, __m512 yv, __m512 low) {
    const __m512 q = _mm512_mul_ps(a, yv);
    const __m512 r = _mm512_fnmadd_ps(q, bv, a);  /* exact: a - q b */
    const __m512 q2 = _mm512_fmadd_ps(r, yv, q);
    const __mmask16 slow = _mm512_cmp_ps_mask(_mm512_abs_ps(a), low, _CMP_LT_OQ)
                           & _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    return slow ? _mm512_mask_div_ps(q2, slow, a, bv) : q2;
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

/* 16 codes' map values of a block codec from element e (a multiple of 16): a gather from the 256-entry map (in L1;
 * the map in sixteen registers left too few for the rest of the step), a permute of the 16-entry one */
static inline __m512 map16(const codec_t *c, __m512 tab16, int64_t e) {
    if (c->kind == C_BLOCK8) {
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)c->data + e)));
        return _mm512_i32gather_ps(code, c->qmap, 4);
    }
    /* C_BLOCK4: 8 bytes, the first code of a byte in its high half */
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)c->data + e / 2)));
    const __m512i pairs = _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), bytes);
    const __m512i shift = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(pairs, shift), _mm512_set1_epi32(15));
    return _mm512_permutexvar_ps(code, tab16);
}

/* A block codec's scales along a tile, 16 elements at a time: the block's scale, reloaded at each block's start */
typedef struct {
    const codec_t *c;
    int64_t block, left;  /* the current block, and the registers left in it */
    __m512 scale;
} scales16_t;

static inline void scales16_start(scales16_t *t, const codec_t *c, int64_t e) {
    t->c = c;
    t->block = e / c->block;
    t->left = c->block / 16;
    t->scale = _mm512_set1_ps(scale_at(c, t->block));
}

static inline void scales16_next(scales16_t *t) {
    if (--t->left > 0) return;
    t->block++;
    t->left = t->c->block / 16;
    t->scale = _mm512_set1_ps(scale_at(t->c, t->block));
}

/* count(points <= x) of 16 normalized values on a 256-code map: the range table's gather (count_le_many's) */
static inline __m512i codes16_table(const codec_t *c, __m512 x, int signed_zero_possible) {
    if (signed_zero_possible) x = _mm512_add_ps(x, _mm512_setzero_ps());  /* -0 -> +0 */
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i key = _mm512_xor_si512(bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31),
                                                                 _mm512_set1_epi32(0x7FFFFFFF)));
    /* the table's range index is (key >> 16) + 32768: the offset is in the base address */
    const __m512i e = _mm512_i32gather_epi32(_mm512_srai_epi32(key, 16), c->nearest.packed + 32768, 4);
    const __mmask16 up = _mm512_cmp_epi32_mask(_mm512_and_si512(key, _mm512_set1_epi32(0xFFFF)),
                                               _mm512_and_si512(e, _mm512_set1_epi32(0x1FFFF)), _MM_CMPINT_NLT);
    const __m512i base = _mm512_srli_epi32(e, 17);
    return _mm512_mask_add_epi32(base, up, base, _mm512_set1_epi32(1));
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

static inline __m512i codes16_search(const search16_t *t, __m512 x, int nan_possible) {
    __m512i count = _mm512_setzero_si512();
    for (int32_t r = 0, step = 1 << (t->rounds - 1); r < t->rounds; r++, step /= 2)
        count = _mm512_mask_add_epi32(count, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(count, t->round[r]), _CMP_GE_OQ),
                                      count, _mm512_set1_epi32(step));
    if (!nan_possible) return count;
    const __mmask16 high_nan = _mm512_cmpgt_epi32_mask(_mm512_castps_si512(x), _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(count, high_nan, _mm512_set1_epi32(t->n_points));
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

/* encode() of a block codec, vectorized: x holds cnt values (padded here with zeros to whole blocks) */
static void encode_blocks16(codec_t *c, int64_t off, int64_t cnt, float *x) {
    const int64_t B = c->block, padded = (cnt + B - 1) / B * B;
    for (int64_t i = cnt; i < padded; i++) x[i] = 0.0f;
    search16_t search;
    if (c->kind == C_BLOCK4) search16_init(&search, &c->nearest);
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
    for (int64_t b0 = 0; b0 < padded; b0 += B) {
        /* |x| as int32 patterns order like the floats (NaN above inf): their max is the absmax, and the unsigned
         * min of pattern - 1 the smallest nonzero magnitude less one (a zero wraps to the largest) */
        __m512i amax_bits = _mm512_setzero_si512(), min_bits = _mm512_set1_epi32(-1);
        for (int64_t i = b0; i < b0 + B; i += 16) {
            const __m512i a = _mm512_and_si512(_mm512_loadu_si512(x + i), magnitude);
            amax_bits = _mm512_max_epi32(amax_bits, a);
            min_bits = _mm512_min_epu32(min_bits, _mm512_sub_epi32(a, one));
        }
        const int32_t top = _mm512_reduce_max_epi32(amax_bits);
        const uint32_t low = _mm512_reduce_min_epu32(min_bits);
        float amax;
        memcpy(&amax, &top, 4);
        amax = store_scale(c, (off + b0) / B, amax);
        const float div = amax != amax ? amax : amax > TINY_NORMAL ? amax : TINY_NORMAL;
        const float safe = div * 0x1p-100f > SAFE_LOW ? div * 0x1p-100f : SAFE_LOW;  /* quotients from 2^-100 on */
        uint32_t safe_bits;
        memcpy(&safe_bits, &safe, 4);
        const int how = !(div >= SAFE_LOW && div <= SAFE_HIGH) ? BY_DIVISION
                        : low >= safe_bits - 1 ? BY_RECIPROCAL : BY_RECIPROCAL_CHECKED;
        const __m512 dv = _mm512_set1_ps(div), yv = _mm512_set1_ps(how != BY_DIVISION ? 1.0f / div : 0.0f);
        const __m512 lowv = _mm512_set1_ps(safe);
        if (c->kind == C_BLOCK8) {
            for (int64_t i = b0; i < b0 + B; i += 16) {
                /* the unchecked reciprocal gives +0 for a zero and normal numbers for the rest: no -0 to normalize */
                const __m512i code = codes16_table(c, normalize16(how, _mm512_loadu_ps(x + i), dv, yv, lowv), how != BY_RECIPROCAL);
                _mm_storeu_si128((__m128i *)((uint8_t *)c->data + off + i), _mm512_cvtepi32_epi8(code));
            }
            continue;
        }
        /* C_BLOCK4, 32 at a time: two codes a byte, the first in the high half */
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        const int nan_possible = how == BY_DIVISION;
        for (int64_t i = b0; i < b0 + B; i += 32) {
            const __m512i a = codes16_search(&search, normalize16(how, _mm512_loadu_ps(x + i), dv, yv, lowv), nan_possible);
            const __m512i z = codes16_search(&search, normalize16(how, _mm512_loadu_ps(x + i + 16), dv, yv, lowv), nan_possible);
            const __m512i hi = _mm512_permutex2var_epi32(a, even, z), lo = _mm512_permutex2var_epi32(a, odd, z);
            _mm_storeu_si128((__m128i *)((uint8_t *)c->data + (off + i) / 2),
                             _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_slli_epi32(hi, 4), lo)));
        }
    }
}

/* Whether the fused path takes this step: AdamW writing a weight (to nearest if bf16) with two block-coded moments
 * (256-code or 16-code maps, absmax scales, blocks of whole pairs of registers) */
static int adamw_blocks16_applies(const step_t *s) {
    if (s->rule != RULE_ADAMW || s->direction_only || s->n_codecs != 2) return 0;
    if (!(s->bias2_sqrt >= 0x1p-60f && s->bias2_sqrt <= 0x1p60f)) return 0;  /* adamw_denom's reciprocal */
    if (s->param_dtype == D_BF16 && s->rounding != W_NEAREST) return 0;
    for (int k = 0; k < 2; k++) {
        const codec_t *c = &s->codecs[k];
        const int ok8 = c->kind == C_BLOCK8 && c->qmap_n == 256 && c->nearest.packed != NULL;
        const int ok4 = c->kind == C_BLOCK4 && c->qmap_n == 16 && c->nearest.n_points <= 15;
        if (!(ok8 || ok4) || c->scale_kind != S_ABSMAX || c->block % 32 != 0) return 0;
    }
    return 1;
}

/* step_range's AdamW tile [t0, t0 + cnt), cnt a multiple of 16, on the fused path: the new moments into m and v */
static void adamw_blocks16_tile(const step_t *s, int64_t t0, int64_t cnt, float *m, float *v) {
    const codec_t *cm = &s->codecs[0], *cv = &s->codecs[1];
    const __m512 tab_m = _mm512_loadu_ps(cm->qmap), tab_v = _mm512_loadu_ps(cv->qmap);  /* 16-entry maps */
    const __m512 w1 = _mm512_set1_ps(s->w1), w2 = _mm512_set1_ps(s->w2), beta2 = _mm512_set1_ps(s->beta2);
    const __m512 eps = _mm512_set1_ps(s->eps), b2s = _mm512_set1_ps(s->bias2_sqrt);
    const __m512 yb = _mm512_set1_ps(1.0f / s->bias2_sqrt), alpha = _mm512_set1_ps(s->alpha);
    const __m512 decay = _mm512_set1_ps(s->decay), w1_hi = _mm512_set1_ps(s->w1 - 1.0f);
    const int lerp_low = fabsf(s->w1) < 0.5f, eps_before = s->eps_before, has_decay = s->has_decay;
    const int32_t grad_dtype = s->grad_dtype, param_dtype = s->param_dtype;
    const void *grad = s->grad;
    void *param = s->param;
    scales16_t sm, sv;
    scales16_start(&sm, cm, t0);
    scales16_start(&sv, cv, t0);
    for (int64_t i = 0; i < cnt; i += 16) {
        const int64_t e = t0 + i;
        const __m512 g = load16(grad, grad_dtype, e);
        __m512 mv = _mm512_mul_ps(map16(cm, tab_m, e), sm.scale), vv = _mm512_mul_ps(map16(cv, tab_v, e), sv.scale);
        scales16_next(&sm);
        scales16_next(&sv);
        const __m512 diff = _mm512_sub_ps(g, mv);  /* lerp(m, g, w1) as torch's vectorized lerp */
        mv = lerp_low ? _mm512_fmadd_ps(w1, diff, mv) : _mm512_fmadd_ps(w1_hi, diff, g);
        vv = _mm512_fmadd_ps(_mm512_mul_ps(w2, g), g, _mm512_mul_ps(vv, beta2));
        const __m512 d = _mm512_div_ps(mv, adamw_denom(vv, b2s, yb, eps, eps_before));
        _mm512_storeu_ps(m + i, mv);
        _mm512_storeu_ps(v + i, vv);
        if (param_dtype == D_FP32) {
            float *p = (float *)param + e;
            __m512 w = _mm512_loadu_ps(p);
            if (has_decay) w = _mm512_mul_ps(w, decay);
            _mm512_storeu_ps(p, _mm512_fmadd_ps(d, alpha, w));
        } else {
            uint16_t *p = (uint16_t *)param + e;
            __m512 w = load16(p, D_BF16, 0);
            if (has_decay)  /* rounded to bf16 (p.mul_) before the update */
                w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(_mm512_mul_ps(w, decay))), 16));
            _mm256_storeu_si256((__m256i *)p, to_bf16_16(_mm512_fmadd_ps(d, alpha, w)));
        }
    }
}

/* The fused path over [lo, hi) (lo a multiple of tile) in runs of whole tiles of about 2048 elements (fewer
 * set-ups than tile by tile; the block codecs carry nothing from one run to the next, so the bits do not depend on
 * where runs end); m and v: (MAX_TILE,) buffers. Returns where the general loop takes over: hi, or the start of a
 * last run whose length is not a multiple of 16. */
static int64_t adamw_blocks16_range(step_t *s, int64_t tile, int64_t lo, int64_t hi, float *m, float *v) {
    const int64_t run = tile * (2048 / tile > 1 ? 2048 / tile : 1);
    for (int64_t t0 = lo; t0 < hi; t0 += run) {
        const int64_t cnt = hi - t0 < run ? hi - t0 : run;
        if (cnt % 16 != 0) return t0;
        adamw_blocks16_tile(s, t0, cnt, m, v);
        encode_blocks16(&s->codecs[0], t0, cnt, m);
        encode_blocks16(&s->codecs[1], t0, cnt, v);
    }
    return hi;
}

#endif /* __AVX512F__ */
