/* One element-wise optimizer step over a window of one parameter, in a single pass.
 *
 * The eager step (slimopt/optim/routes/windowed.py) decodes each stored moment into a full fp32 tensor, runs the rule
 * op by op (a dozen passes over memory), encodes the moments back and writes the weight. This kernel does the
 * same arithmetic tile by tile: a tile of a few hundred elements (whole codec blocks) is decoded into stack
 * buffers, updated in registers, encoded and written before the next tile, so the gradient, the weight and each
 * coded moment are read once and written once.
 *
 * Rules (slimopt/optim/algorithm/rules.py): AdamW (arXiv 1412.6980, 1711.05101; eps after the bias correction as
 * torch.optim.AdamW, or before it as galore-torch), Lion (arXiv 2302.06675), heavy-ball and Nesterov SGD
 * momentum, and the state-free sign or SGD update (signSGD, FRUGAL's residual, arXiv 2411.07837). A bf16 weight
 * is written to nearest, or stochastically rounded from its own counter-based stream, or with a Kahan
 * compensation (rules.rounded).
 * Codecs (slimopt/optim/algorithm/codecs.py): fp32, bf16 (nearest), blockwise absmax int8 / int4 on a sorted map
 * (arXiv 2110.02861, 2309.01507), ternary with stochastic rounding or with a carried ternary residual, scaled by
 * the block's absmax, mean magnitude (arXiv 2402.17764) or root mean square, the scale stored fp32 or bf16;
 * an Adafactor-style factored second moment (arXiv 1804.04235) over a window of whole rows.
 *
 * The arithmetic follows torch's CPU kernels operation for operation, so that the result equals the eager step
 * (tests/test_native.py): lerp as fma(w, end - self, self) for |w| < 0.5 (else fma(w - 1, end - self, end)),
 * add-with-alpha as fma(other, alpha, self), each other operation rounded to fp32 on its own (compiled with
 * -ffp-contract=off so that the compiler fuses nothing else). Nearest and stochastic codes are the exact
 * integer answers of slimopt.optim.algorithm.quant (count of decision points <= x, found through the same 65536-range
 * look-up table), so codes agree whenever the fp32 moment does.
 *
 * On a processor with AVX-512, AdamW's step takes adamw_avx512.h: the same arithmetic sixteen elements a register,
 * in one pass, with the divisions by shared values through a correctly rounded reciprocal.
 *
 * slimopt_column_best is TACO's candidate search (arXiv 2610.02199; slimopt/optim/algorithm/taco.py) at
 * one candidate a column: one pass over the gradient instead of |g|, a scatter and a strided argmax;
 * slimopt_taco_one is TACO's whole step at one stored component a column, that search included.
 *
 * Stochastic codecs draw their uniform [0, 1) numbers themselves, from the counter-based stream of
 * slimopt/optim/algorithm/noise.py: the number of element j of the parameter is a half of a hash of (key, j / 2), so
 * every tile computes exactly what the eager encode draws for its elements, with nothing read from memory.
 */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* The ids of slimopt/optim/routes/abi.py (tests/test_native.py holds the two alike): state-full rules below
 * RULE_FIRST_FREE; RULE_SIGN, RULE_SGD: the state-free update (no moments) of FRUGAL's residual, an inactive
 * block, signSGD; RULE_LIFT_SIGN, RULE_LIFT_SGD: a projected step's write with FRUGAL's residual (step_t's lift
 * fields) */
enum { RULE_ADAMW = 0, RULE_LION = 1, RULE_SGDM = 2, RULE_NESTEROV = 3, RULE_FIRST_FREE = 16, RULE_SIGN = 16,
       RULE_SGD = 17, RULE_LIFT_SIGN = 18, RULE_LIFT_SGD = 19 };
enum { C_FP32 = 0, C_BF16 = 1, C_BLOCK8 = 2, C_BLOCK4 = 3, C_TERNARY_SR = 4, C_TERNARY_EF = 5, C_FACTORED = 6 };
enum { D_FP32 = 0, D_BF16 = 1 };
enum { W_NEAREST = 0, W_STOCHASTIC = 1, W_KAHAN = 2 };
enum { S_ABSMAX = 0, S_MEAN = 1, S_RMS = 2 };

#define MAX_TILE 4096

/* count(points <= x) through a range table (quant._CountTable): base[range(x)] + comparisons with the next
 * `extra` points; `points` is NaN-padded so that reading past the last point compares false. */
typedef struct {
    const int32_t *base;  /* (65536,) */
    const float *points;  /* (n_points + extra,) */
    int32_t extra;
    /* (65536,) or NULL; where no range holds more than one point: (base[r] + 1) << 16 - t, t the low 16 bits of
     * the order key of the point in range r (65536 if none), so that count = (packed + low16(key)) >> 16 (the
     * carry out of the low 16 bits is low16(key) >= t): one look-up instead of two dependent ones */
    const int32_t *packed;
    int32_t n_points;     /* the points before the NaN padding */
} count_table_t;

typedef struct {
    int32_t kind;          /* C_* */
    int32_t block;         /* elements per block (1 for fp32 / bf16) */
    void *data;            /* fp32 / bf16 values, or uint8 codes (packed for int4 and ternary) */
    void *scale;           /* per-block scale (block and ternary codecs): fp32, or bf16 where scale_bf16 */
    uint8_t *err;          /* ternary residual trits (C_TERNARY_EF) */
    const float *qmap;     /* sorted map (block and ternary codecs) */
    int32_t qmap_n;
    count_table_t nearest; /* decision points of nearest rounding */
    count_table_t bracket; /* the map's own points (stochastic rounding) */
    uint32_t key0, key1;   /* stochastic codecs: the stream's key (low, high word) */
    int64_t counter;       /* stochastic codecs: the stream's counter of the window's first element */
    int32_t scale_kind;    /* S_*: what a block's scale measures (block codecs: S_ABSMAX) */
    int32_t scale_bf16;    /* the scale is stored as bf16 (and normalizes as that rounded value) */
    /* C_FACTORED (a window of whole rows of an (R, cols) moment): v[r, c] = row[r] * col[c] / denom */
    float *row;            /* (window rows,) the window's row means: read, then overwritten by the new ones */
    const float *col;      /* (cols,) the column means stored before the pass */
    double *col_sum;       /* (cols,) the pass's column sums, added to */
    int64_t cols;
    float denom;           /* mean of the row means before the pass, clamped to the smallest normal */
    double row_acc;        /* the sum of the current row so far (rows span tiles) */
    const float *pairs;    /* C_BLOCK4: (256, 2) the two map values of every byte, set by the step itself */
} codec_t;

typedef struct {
    int64_t n;             /* elements in the window */
    void *param;           /* (n,) D_FP32 / D_BF16 */
    int32_t param_dtype;
    const void *grad;      /* (n,) D_FP32 / D_BF16 */
    int32_t grad_dtype;
    int32_t rule;
    int32_t has_decay;     /* weight decay != 0: the weight is multiplied by `decay` first (and rounded) */
    float decay;           /* 1 - lr * weight_decay */
    float alpha;           /* -lr * coefficient: weight += alpha * direction */
    float w1;              /* adamw / lion: 1 - beta1 (the lerp weight of m) */
    float beta2;           /* adamw: beta2 */
    float w2;              /* adamw: 1 - beta2 (addcmul's value); lion: 1 - beta2 (m's lerp weight) */
    float bias2_sqrt;      /* adamw: sqrt(1 - beta2^t) */
    float eps;
    int32_t eps_before;    /* adamw: galore-torch's placement (sqrt(v) + eps) / bias2_sqrt */
    float momentum;        /* sgdm, nesterov */
    int32_t n_codecs;      /* moments of the rule: adamw 2 (m, v), lion, sgdm and nesterov 1, sign and sgd 0 */
    int32_t direction_only; /* param is an fp32 (n,) buffer that receives the direction d (a projected step's
                             * subspace rule, windowed.directions): no decay, no weight update */
    int32_t rounding;      /* W_*: how a bf16 weight is written (rules.rounded); fp32 weights: W_NEAREST */
    uint16_t *comp;        /* W_KAHAN: (n,) bf16, what the weight's rounding lost, read and rewritten */
    uint32_t wkey0, wkey1; /* W_STOCHASTIC: the weight's stream (noise.CounterStream), key words */
    int64_t wcounter;      /* W_STOCHASTIC: the stream's counter of the window's first element */
    codec_t codecs[2];
    /* RULE_LIFT_*: grad is the lifted state-full direction L (the subspace rule's, projected back), g the
     * gradient, up its part inside the subspace U; the direction is fma(free(r), free_scale, L * lift_coef) with
     * r = -U + g (projectors.residual) and free sign or the identity: rules.apply_update's arithmetic */
    const void *g;         /* (n,) D_FP32 / D_BF16 */
    int32_t g_dtype;
    const float *up;       /* (n,) fp32 */
    float lift_coef;
    float free_scale;
    int32_t threads;       /* worker threads the window may be split over (1: this thread only) */
    /* or NULL: the weight's int8 codes and scales written from its new value in the step's pass, rows as soon as
     * their group is stepped (still in cache); the window is the whole (rows, cols) weight (int8_weight.h) */
    const struct int8q *int8;
    int32_t int8_written;  /* out: 1 where every row's codes were written; 0 at a NaN or an infinity */
} step_t;

static float TRITS[256][5];  /* base-3 digits of every byte value minus 1 (the trits -1, 0, 1), lowest first */
static int trits_ready = 0;

static void init_trits(void) {
    for (int b = 0; b < 256; b++) {
        int x = b;
        for (int k = 0; k < 5; k++) { TRITS[b][k] = (float)(x % 3 - 1); x /= 3; }
    }
    trits_ready = 1;
}

static const int POW3[5] = {1, 3, 9, 27, 81};

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float scale_at(const codec_t *c, int64_t blk) {
    return c->scale_bf16 ? bf16_to_f32(((const uint16_t *)c->scale)[blk]) : ((const float *)c->scale)[blk];
}

/* Store a block's scale in the codec's dtype and return what was stored, as fp32 */
static inline float store_scale(const codec_t *c, int64_t blk, float s) {
    if (!c->scale_bf16) {
        ((float *)c->scale)[blk] = s;
        return s;
    }
    const uint16_t h = f32_to_bf16(s);
    ((uint16_t *)c->scale)[blk] = h;
    return bf16_to_f32(h);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline int32_t count_le(const count_table_t *t, float x) {
    float y = x + 0.0f;  /* -0.0 -> +0.0 */
    int32_t bits;
    memcpy(&bits, &y, 4);
    int32_t key = bits ^ ((bits >> 31) & 0x7FFFFFFF);
    int32_t idx = t->base[(key >> 16) + 32768];
    int32_t count = idx;
    for (int32_t k = 0; k < t->extra; k++) count += (x >= t->points[idx + k]);
    return count;
}

#ifdef __AVX512F__
/* count_le for n values against at most 15 points, sixteen values at a time: a branch-free binary search over the
 * points held in one register (padded with NaN, which no x is >= of), each round a permute and a comparison.
 * That is the table's count for every x but a NaN, which compares false with every point: the table counts a
 * NaN with the sign bit clear above every point and one with it set below every point (its order key), so the
 * first kind is set to n_points. */
static void count_le_compare(const count_table_t *t, const float *x, int32_t *out, int64_t n) {
    const int32_t np = t->n_points;
    float padded[16];
    for (int k = 0; k < 16; k++) padded[k] = k < np ? t->points[k] : NAN;
    const __m512 tab = _mm512_loadu_ps(padded);
    int32_t half = 1;  /* the first step: 2^(L-1) for the least L with 2^L - 1 >= np */
    while (2 * half - 1 < np) half *= 2;
    const __m512i inf_bits = _mm512_set1_epi32(0x7F800000), all = _mm512_set1_epi32(np);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        __m512i count = _mm512_setzero_si512();
        for (int32_t step = half; step >= 1; step /= 2) {
            const __m512 point = _mm512_permutexvar_ps(_mm512_add_epi32(count, _mm512_set1_epi32(step - 1)), tab);
            const __mmask16 ge = _mm512_cmp_ps_mask(v, point, _CMP_GE_OQ);
            count = _mm512_mask_add_epi32(count, ge, count, _mm512_set1_epi32(step));
        }
        const __mmask16 high_nan = _mm512_cmpgt_epi32_mask(_mm512_castps_si512(v), inf_bits);
        _mm512_storeu_si512(out + i, _mm512_mask_mov_epi32(count, high_nan, all));
    }
    for (; i < n; i++) out[i] = count_le(t, x[i]);
}
#elif defined(__AVX2__)
/* count_le for n values against at most 15 points, eight values at a time: one comparison with every point (held
 * broadcast in registers) and the count of those that hold; faster than the table's gather on the processors
 * tried, and the same count (a NaN: as the AVX-512 search above) */
static void count_le_compare(const count_table_t *t, const float *x, int32_t *out, int64_t n) {
    const int32_t np = t->n_points;
    __m256 point[15];
    for (int k = 0; k < np; k++) point[k] = _mm256_set1_ps(t->points[k]);
    const __m256i inf_bits = _mm256_set1_epi32(0x7F800000), all = _mm256_set1_epi32(np);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        __m256i count = _mm256_setzero_si256();
        for (int k = 0; k < np; k++)  /* a true comparison is all ones: -1 */
            count = _mm256_sub_epi32(count, _mm256_castps_si256(_mm256_cmp_ps(v, point[k], _CMP_GE_OQ)));
        const __m256i high_nan = _mm256_cmpgt_epi32(_mm256_castps_si256(v), inf_bits);
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_blendv_epi8(count, all, high_nan));
    }
    for (; i < n; i++) out[i] = count_le(t, x[i]);
}
#endif

/* count_le for n values at once; the common case of at most one point per range (every map here) as a loop
 * the compiler vectorizes (a gather from the table, one from the points, one comparison). */
static void count_le_many(const count_table_t *t, const float *x, int32_t *out, int64_t n) {
    const int32_t *packed = t->packed;
#if defined(__AVX512F__) || defined(__AVX2__)
    if (t->n_points <= 15) {  /* a 4-bit or ternary map: a search in registers, no look-up */
        count_le_compare(t, x, out, n);
        return;
    }
#endif
    if (packed == NULL) {
        for (int64_t i = 0; i < n; i++) out[i] = count_le(t, x[i]);
        return;
    }
    int64_t i = 0;
#ifdef __AVX2__
    /* the loop below, eight at a time: the gather is what the compiler will not emit on its own */
    const __m256 zero = _mm256_setzero_ps();
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), half = _mm256_set1_epi32(32768);
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    for (; i + 8 <= n; i += 8) {
        __m256i bits = _mm256_castps_si256(_mm256_add_ps(_mm256_loadu_ps(x + i), zero));
        __m256i key = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), magnitude));
        __m256i e = _mm256_i32gather_epi32(packed, _mm256_add_epi32(_mm256_srai_epi32(key, 16), half), 4);
        const __m256i count = _mm256_srli_epi32(_mm256_add_epi32(e, _mm256_and_si256(key, low16)), 16);
        _mm256_storeu_si256((__m256i *)(out + i), count);
    }
#endif
    for (; i < n; i++) {
        float y = x[i] + 0.0f;
        int32_t bits;
        memcpy(&bits, &y, 4);
        int32_t key = bits ^ ((bits >> 31) & 0x7FFFFFFF);
        int32_t e = packed[(key >> 16) + 32768];
        out[i] = (e + (key & 0xFFFF)) >> 16;
    }
}

#ifdef __AVX512F__
#include "map256_avx512.h"
#include "nearest8_avx512.h"
#endif

/* The trits of elements [off, off + cnt) of a packed base-3 array (off a multiple of 5) times unit, then times
 * their block's scale, into out, as TernaryCodec._trits_times_scale: ((digit - 1) * unit) * scale. */
static void ternary_values(const codec_t *c, const uint8_t *packed, int64_t off, int64_t cnt, float unit,
                           float *out) {
    float t[MAX_TILE + 5];
    const uint8_t *d = packed + off / 5;
    for (int64_t j = 0; j * 5 < cnt; j++) memcpy(t + 5 * j, TRITS[d[j]], 5 * sizeof(float));
    for (int64_t b0 = 0; b0 < cnt; b0 += c->block) {
        const float scale = scale_at(c, (off + b0) / c->block);
        const int64_t e = cnt - b0 < c->block ? cnt - b0 : c->block;
        for (int64_t i = b0; i < b0 + e; i++) out[i] = (t[i] * unit) * scale;
    }
}

#ifdef __AVX512F__
/* tab[code] for sixteen codes in [0, 256), tab the map in sixteen registers of sixteen entries */
static inline __m512 map256(const __m512 *tab, __m512i code) {
    __m512 r[8];
    for (int k = 0; k < 8; k++) r[k] = _mm512_permutex2var_ps(tab[2 * k], code, tab[2 * k + 1]);
    const __mmask16 b5 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(code, _mm512_set1_epi32(128));
    for (int k = 0; k < 4; k++) r[k] = _mm512_mask_blend_ps(b5, r[2 * k], r[2 * k + 1]);
    for (int k = 0; k < 2; k++) r[k] = _mm512_mask_blend_ps(b6, r[2 * k], r[2 * k + 1]);
    return _mm512_mask_blend_ps(b7, r[0], r[1]);
}
#endif

/* Decode elements [off, off + cnt) of the window into out. */
static void decode(const codec_t *c, int64_t off, int64_t cnt, float *out) {
    switch (c->kind) {
    case C_FACTORED:  /* (row * col) / denom, as outer(row, col) / denom; row by row segment */
        for (int64_t e = off; e < off + cnt;) {
            const int64_t r = e / c->cols, c0 = e % c->cols;
            const int64_t len = c->cols - c0 < off + cnt - e ? c->cols - c0 : off + cnt - e;
            const float rv = c->row[r], dn = c->denom;
            const float *col = c->col + c0;
            float *o = out + (e - off);
            for (int64_t k = 0; k < len; k++) o[k] = (rv * col[k]) / dn;
            e += len;
        }
        break;
    case C_FP32:
        memcpy(out, (const float *)c->data + off, (size_t)cnt * 4);
        break;
    case C_BF16: {
        const uint16_t *d = (const uint16_t *)c->data + off;
        for (int64_t i = 0; i < cnt; i++) out[i] = bf16_to_f32(d[i]);
        break;
    }
    case C_BLOCK8: {  /* off and the tile are whole blocks */
        const uint8_t *d = (const uint8_t *)c->data + off;
#ifdef __AVX512F__
        /* the 256-entry map in sixteen registers: two-source permutes pick among 32 entries by the code's low five
         * bits, three rounds of blends by its high three; faster than a gather, and the same values */
        __m512 tab[16];
        for (int k = 0; k < 16; k++) tab[k] = _mm512_loadu_ps(c->qmap + 16 * k);
#endif
        for (int64_t b0 = 0; b0 < cnt; b0 += c->block) {
            const float scale = scale_at(c, (off + b0) / c->block);
            const int64_t e = cnt - b0 < c->block ? cnt - b0 : c->block;
            int64_t i = 0;
#ifdef __AVX512F__
            const __m512 sz = _mm512_set1_ps(scale);
            for (; i + 16 <= e; i += 16) {
                const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(d + b0 + i)));
                _mm512_storeu_ps(out + b0 + i, _mm512_mul_ps(map256(tab, code), sz));
            }
#endif
#ifdef __AVX2__
            const __m256 sv = _mm256_set1_ps(scale);
            for (; i + 8 <= e; i += 8) {
                __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(d + b0 + i)));
                _mm256_storeu_ps(out + b0 + i, _mm256_mul_ps(_mm256_i32gather_ps(c->qmap, code, 4), sv));
            }
#endif
            for (; i < e; i++) out[b0 + i] = c->qmap[d[b0 + i]] * scale;
        }
        break;
    }
    case C_BLOCK4: {  /* a byte holds two codes, the first in its high half: both values from one look-up */
        const uint8_t *d = (const uint8_t *)c->data + off / 2;
#ifdef __AVX512F__
        if (c->block % 32 == 0 && c->qmap_n == 16) {  /* the 16-entry map in one register: a permute is the look-up */
            const __m512 tab = _mm512_loadu_ps(c->qmap);
            const __m512i nib = _mm512_set1_epi32(15);
            /* the values of 16 bytes' high codes (h) and low codes (l) interleaved: h0 l0 h1 l1 ... */
            const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
            for (int64_t b0 = 0; b0 < cnt; b0 += c->block) {
                const __m512 sz = _mm512_set1_ps(scale_at(c, (off + b0) / c->block));
                const int64_t e = cnt - b0 < c->block ? cnt - b0 : c->block;  /* a whole block but the last */
                int64_t i = 0;
                for (; i + 32 <= e; i += 32) {
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(d + (b0 + i) / 2)));
                    const __m512 h = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
                    const __m512 l = _mm512_permutexvar_ps(_mm512_and_si512(b, nib), tab);
                    _mm512_storeu_ps(out + b0 + i, _mm512_mul_ps(_mm512_permutex2var_ps(h, first, l), sz));
                    _mm512_storeu_ps(out + b0 + i + 16, _mm512_mul_ps(_mm512_permutex2var_ps(h, second, l), sz));
                }
                const float scale = scale_at(c, (off + b0) / c->block);
                for (; i < e; i += 2) {
                    const uint8_t byte = d[(b0 + i) / 2];
                    out[b0 + i] = c->qmap[byte >> 4] * scale;
                    if (i + 1 < e) out[b0 + i + 1] = c->qmap[byte & 15] * scale;
                }
            }
            break;
        }
#elif defined(__AVX2__)
        if (c->block % 16 == 0 && c->qmap_n == 16) {  /* the map in two registers: permutes and a blend */
            const __m256 lo8 = _mm256_loadu_ps(c->qmap), hi8 = _mm256_loadu_ps(c->qmap + 8);
            const __m256i nib = _mm256_set1_epi32(15);
            for (int64_t b0 = 0; b0 < cnt; b0 += c->block) {
                const float scale = scale_at(c, (off + b0) / c->block);
                const __m256 sz = _mm256_set1_ps(scale);
                const int64_t e = cnt - b0 < c->block ? cnt - b0 : c->block;  /* a whole block but the last */
                int64_t i = 0;
                for (; i + 16 <= e; i += 16) {
                    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(d + (b0 + i) / 2)));
                    const __m256i hc = _mm256_srli_epi32(b, 4), lc = _mm256_and_si256(b, nib);
                    /* code < 8 from the first register, else the second: bit 3 moved to the sign for the blend */
                    const __m256 h = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo8, hc), _mm256_permutevar8x32_ps(hi8, hc),
                                                      _mm256_castsi256_ps(_mm256_slli_epi32(hc, 28)));
                    const __m256 l = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo8, lc), _mm256_permutevar8x32_ps(hi8, lc),
                                                      _mm256_castsi256_ps(_mm256_slli_epi32(lc, 28)));
                    /* interleave h0 l0 h1 l1 ...: unpack within 128-bit lanes, then put the lanes in order */
                    const __m256 a = _mm256_unpacklo_ps(h, l), z = _mm256_unpackhi_ps(h, l);
                    _mm256_storeu_ps(out + b0 + i, _mm256_mul_ps(_mm256_permute2f128_ps(a, z, 0x20), sz));
                    _mm256_storeu_ps(out + b0 + i + 8, _mm256_mul_ps(_mm256_permute2f128_ps(a, z, 0x31), sz));
                }
                for (; i < e; i += 2) {
                    const uint8_t byte = d[(b0 + i) / 2];
                    out[b0 + i] = c->qmap[byte >> 4] * scale;
                    if (i + 1 < e) out[b0 + i + 1] = c->qmap[byte & 15] * scale;
                }
            }
            break;
        }
#endif
        float t[MAX_TILE + 2];
        for (int64_t j = 0; 2 * j < cnt; j++) memcpy(t + 2 * j, c->pairs + 2 * d[j], 2 * sizeof(float));
        for (int64_t b0 = 0; b0 < cnt; b0 += c->block) {
            const float scale = scale_at(c, (off + b0) / c->block);
            const int64_t e = cnt - b0 < c->block ? cnt - b0 : c->block;
            for (int64_t i = b0; i < b0 + e; i++) out[i] = t[i] * scale;
        }
        break;
    }
    default:  /* ternary: (digit - 1) * block scale; off is a multiple of 5 */
        ternary_values(c, (const uint8_t *)c->data, off, cnt, 1.0f, out);
    }
}

static inline uint32_t mix32(uint32_t x) {  /* noise._mix32_ */
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* The stream's 32-bit key: its two key words mixed (noise.CounterStream.key32), once per call */
static inline uint32_t stream_key(uint32_t key0, uint32_t key1) { return mix32(mix32(key1) ^ key0); }

/* The 32-bit hash of counter j under the stream key k (noise.CounterStream.bits): one mix32 of j's low word, its
 * high word times STREAM_PHI and k */
#define STREAM_PHI 0x9E3779B9u
static inline uint32_t stream_hash(uint32_t k, int64_t j) {
    const uint64_t u = (uint64_t)j;
    return mix32((uint32_t)u ^ (uint32_t)(u >> 32) * STREAM_PHI ^ k);
}

/* The 16-bit number of counter j of the stream (noise.CounterStream.int16): a half of the hash of j / 2, the high
 * half for an even j, the low half for an odd one */
static inline uint32_t stream16(uint32_t k, int64_t j) {
    const uint32_t h = stream_hash(k, j >> 1);
    return (j & 1) ? h & 0xFFFFu : h >> 16;
}

/* n uniform [0, 1) numbers of the stream (key0, key1) from counter `j0` on (noise.CounterStream.uniform): each
 * 16-bit number times 2^-16, one hash for each two */
static void uniform_many(uint32_t key0, uint32_t key1, int64_t j0, float *u, int64_t n) {
    const uint32_t k = stream_key(key0, key1);
    int64_t i = 0;
    if (n > 0 && (j0 & 1)) u[i++] = (float)stream16(k, j0) * 0x1p-16f;
    for (; i + 2 <= n; i += 2) {  /* j0 + i even */
        const uint32_t h = stream_hash(k, (j0 + i) >> 1);
        u[i] = (float)(int32_t)(h >> 16) * 0x1p-16f;  /* < 2^16: exact, and a signed conversion vectorizes */
        u[i + 1] = (float)(int32_t)(h & 0xFFFFu) * 0x1p-16f;
    }
    if (i < n) u[i] = (float)stream16(k, j0 + i) * 0x1p-16f;
}

/* quant.to_bf16(stochastic=True) on the stream (key0, key1) from counter j0: element j's 16-bit number added to the
 * low half of the fp32 pattern (int32 arithmetic), truncated; inf and NaN rounded to nearest */
static void stochastic_bf16(uint32_t key0, uint32_t key1, int64_t j0, const float *y, uint16_t *out, int64_t n) {
    const uint32_t k = stream_key(key0, key1);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t r = stream16(k, j0 + i);
        uint32_t bits;
        memcpy(&bits, &y[i], 4);
        const int finite = (bits & 0x7F800000u) != 0x7F800000u;
        out[i] = finite ? (uint16_t)((bits + r) >> 16) : f32_to_bf16(y[i]);
    }
}

/* stochastic_code on the ternary map (-1, 0, 1), n values at once, in a form the compiler vectorizes: the
 * bracketing pair from three comparisons (NaN counts above every point, as quant's search), and
 * (x - lo) / (hi - lo) = x - lo exactly, the spacing being 1. */
static void ternary_sr_many(const float *x, const float *u, int32_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float xi = x[i];
        const int32_t upper = (xi >= 0.0f) | (xi != xi);  /* bracket (0, 1) rather than (-1, 0) */
        float p_up = xi - ((float)upper - 1.0f);
        p_up = p_up < 0.0f ? 0.0f : p_up;  /* clamp_(0, 1); NaN stays NaN and compares false */
        p_up = p_up > 1.0f ? 1.0f : p_up;
        out[i] = upper + (u[i] < p_up);
    }
}

/* digits (n of them, n a multiple of 5 but for the tensor's last byte) into bytes of five base-3 digits, the
 * first weighted 1; the missing digits of a last partial byte are 0 (quant.pack_base3 pads with 0) */
static void pack_trits(const int32_t *digits, int64_t n, uint8_t *bytes) {
    int64_t j = 0;
    for (; j + 5 <= n; j += 5)
        bytes[j / 5] = (uint8_t)(digits[j] + 3 * digits[j + 1] + 9 * digits[j + 2] + 27 * digits[j + 3]
                                 + 81 * digits[j + 4]);
    if (j < n) {
        int32_t byte = 0;
        for (int64_t k = j; k < n; k++) byte += digits[k] * POW3[k - j];
        bytes[j / 5] = (uint8_t)byte;
    }
}

/* The sum of |x| (or of x * x rounded to fp32) over n values, in fp64, in eight chains (one vector register):
 * its order changes the fp64 sum by an ulp of a double at most, which its fp32 rounding does not see. */
static double block_sum(const float *x, int64_t n, int squares) {
    double a[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    if (squares) {
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) a[j] += (double)(x[i + j] * x[i + j]);
        for (; i < n; i++) a[0] += (double)(x[i] * x[i]);
    } else {
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) a[j] += (double)fabsf(x[i + j]);
        for (; i < n; i++) a[0] += (double)fabsf(x[i]);
    }
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* Encode x (cnt values; the rest of the last block is zero padding) as elements [off, ...) of the window.
 * off is a multiple of the codec's block. */
static void encode(codec_t *c, int64_t off, int64_t cnt, float *x) {
    switch (c->kind) {
    case C_FP32:
        memcpy((float *)c->data + off, x, (size_t)cnt * 4);
        return;
    case C_BF16: {
        uint16_t *d = (uint16_t *)c->data + off;
        for (int64_t i = 0; i < cnt; i++) d[i] = f32_to_bf16(x[i]);
        return;
    }
    case C_FACTORED:  /* codecs.factored_means: fp64 row and column sums; a row's mean once the row is complete */
        for (int64_t e = off; e < off + cnt;) {
            const int64_t r = e / c->cols, c0 = e % c->cols;
            const int64_t len = c->cols - c0 < off + cnt - e ? c->cols - c0 : off + cnt - e;
            const float *xs = x + (e - off);
            double *cs = c->col_sum + c0;
            /* 32 chains (four vector registers of doubles; fewer left the adds waiting on each other), each value
             * converted once for its row's and its column's sum, the chains then added pairwise: the order
             * changes the fp64 sum by an ulp of a double at most, which its mean does not see */
            double a[32] = {0.0};
            int64_t k = 0;
#ifdef __AVX512F__  /* chain 8 q + j in lane j of register q */
            __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
            for (; k + 32 <= len; k += 32)
                for (int q = 0; q < 4; q++) {
                    const __m512d d = _mm512_cvtps_pd(_mm256_loadu_ps(xs + k + 8 * q));
                    acc[q] = _mm512_add_pd(acc[q], d);
                    _mm512_storeu_pd(cs + k + 8 * q, _mm512_add_pd(_mm512_loadu_pd(cs + k + 8 * q), d));
                }
            for (int q = 0; q < 4; q++) _mm512_storeu_pd(a + 8 * q, acc[q]);
#endif
            for (; k + 32 <= len; k += 32)
                for (int j = 0; j < 32; j++) {
                    const double d = (double)xs[k + j];
                    a[j] += d;
                    cs[k + j] += d;
                }
            for (; k < len; k++) {
                const double d = (double)xs[k];
                a[0] += d;
                cs[k] += d;
            }
            for (int h = 16; h >= 1; h /= 2)
                for (int j = 0; j < h; j++) a[j] += a[j + h];
            c->row_acc += a[0];
            if (c0 + len == c->cols) {
                c->row[r] = (float)(c->row_acc / (double)c->cols);
                c->row_acc = 0.0;
            }
            e += len;
        }
        return;
    default:
        break;
    }
    const int64_t B = c->block;
    const int64_t padded = (cnt + B - 1) / B * B;
    for (int64_t i = cnt; i < padded; i++) x[i] = 0.0f;
    float nrm[MAX_TILE], u[MAX_TILE];
    if (c->kind == C_TERNARY_EF) {  /* add the carried residual ((digit - 1) * 0.5) * old scale */
        ternary_values(c, c->err, off, cnt, 0.5f, nrm);
        for (int64_t i = 0; i < cnt; i++) x[i] = x[i] + nrm[i];
    }
    int32_t code[MAX_TILE];
    for (int64_t b0 = 0; b0 < padded; b0 += B) {
        float amax;
        if (c->scale_kind == S_ABSMAX) {
            /* |x| as int32 bit patterns order like the floats, and every NaN pattern lies above +inf: an integer
             * max (which vectorizes) is the absmax, and NaN when any entry is NaN, as torch's amax */
            int32_t amax_bits = 0;
            for (int64_t i = b0; i < b0 + B; i++) {
                int32_t bits;
                memcpy(&bits, &x[i], 4);
                bits &= 0x7FFFFFFF;
                amax_bits = bits > amax_bits ? bits : amax_bits;
            }
            memcpy(&amax, &amax_bits, 4);
        } else {
            /* mean of |x| or of x^2 (rounded to fp32, as torch's square) over the block's own values, summed in
             * double as quant.block_absmean / block_rms do: a sum of 64 floats in double is exact or off by
             * an ulp of a double, so the fp32 result equals torch's whatever order its reduction takes */
            const double acc = block_sum(x + b0, B, c->scale_kind == S_RMS);
            const double k = (double)(cnt - b0 < B ? cnt - b0 : B);  /* the padding adds exact zeros */
            amax = c->scale_kind == S_MEAN ? (float)(acc / k) : (float)sqrt(acc / k);
        }
        amax = store_scale(c, (off + b0) / B, amax);
        const float div = amax > 1.17549435e-38f ? amax : 1.17549435e-38f;  /* clamp_min(tiny); NaN stays */
        for (int64_t i = 0; i < B; i++) nrm[b0 + i] = x[b0 + i] / (amax != amax ? amax : div);
    }
    if (c->kind == C_BLOCK8) {
        uint8_t *d = (uint8_t *)c->data + off;
#ifdef __AVX512VBMI__
        const nearest8_t *fit = nearest8_for(&c->nearest, padded);
        if (fit != NULL) {  /* the codes without a gather where gathers are slow (nearest8_avx512.h) */
            nearest8_codes(fit, nrm, padded, d);
            return;
        }
#endif
        count_le_many(&c->nearest, nrm, code, padded);
        for (int64_t i = 0; i < padded; i++) d[i] = (uint8_t)code[i];
    } else if (c->kind == C_BLOCK4) {
        count_le_many(&c->nearest, nrm, code, padded);
        uint8_t *d = (uint8_t *)c->data + off / 2;
        int64_t i = 0;
#ifdef __AVX512F__
        /* 32 codes to 16 bytes: the even ones shifted into the high half, or'ed with the odd ones */
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        for (; i + 32 <= padded; i += 32) {
            const __m512i a = _mm512_loadu_si512(code + i), b = _mm512_loadu_si512(code + i + 16);
            const __m512i hi = _mm512_permutex2var_epi32(a, even, b), lo = _mm512_permutex2var_epi32(a, odd, b);
            _mm_storeu_si128((__m128i *)(d + i / 2), _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_slli_epi32(hi, 4), lo)));
        }
#elif defined(__AVX2__)
        /* 32 codes to 32 bytes in order (two packs, their 128-bit lanes then put in order), each byte pair c0 c1 as
         * a 16-bit word to (c0 << 4) | c1 in its low byte, and the words' low bytes packed: 16 bytes */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), low_byte = _mm256_set1_epi16(0xFF);
        for (; i + 32 <= padded; i += 32) {
            const __m256i *c32 = (const __m256i *)(code + i);
            const __m256i w01 = _mm256_packus_epi32(_mm256_loadu_si256(c32), _mm256_loadu_si256(c32 + 1));
            const __m256i w23 = _mm256_packus_epi32(_mm256_loadu_si256(c32 + 2), _mm256_loadu_si256(c32 + 3));
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23), order);
            const __m256i pair = _mm256_and_si256(low_byte, _mm256_or_si256(_mm256_slli_epi16(bytes, 4),
                                                                            _mm256_srli_epi16(bytes, 8)));
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pair, pair), 0x08);  /* qwords 0, 2 */
            _mm_storeu_si128((__m128i *)(d + i / 2), _mm256_castsi256_si128(packed));
        }
#endif
        for (; i < padded; i += 2) d[i / 2] = (uint8_t)((code[i] << 4) | code[i + 1]);
    } else if (c->kind == C_TERNARY_SR) {  /* off is a multiple of 5: whole bytes */
        uniform_many(c->key0, c->key1, c->counter + off, u, padded);
        ternary_sr_many(nrm, u, code, padded);
        pack_trits(code, padded, (uint8_t *)c->data + off / 5);
    } else {  /* C_TERNARY_EF: nearest trit, and twice the residual rounded stochastically to a trit */
        count_le_many(&c->nearest, nrm, code, padded);
        for (int64_t i = 0; i < padded; i++) nrm[i] = (nrm[i] - (float)(code[i] - 1)) * 2.0f;
        pack_trits(code, padded, (uint8_t *)c->data + off / 5);
        uniform_many(c->key0, c->key1, c->counter + off, u, padded);
        ternary_sr_many(nrm, u, code, padded);
        pack_trits(code, padded, c->err + off / 5);
    }
}

static int64_t gcd(int64_t a, int64_t b) {
    while (b) { int64_t t = a % b; a = b; b = t; }
    return a;
}

static inline float lerp(float self, float end, float w) {  /* torch's vectorized lerp */
    return fabsf(w) < 0.5f ? fmaf(w, end - self, self) : fmaf(w - 1.0f, end - self, end);
}

static inline float sign(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }

#include "adamw_avx512.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* step_range's AdamW loop eight elements at a time where AVX2 is the widest set, bit for bit the scalar loop's:
 * the division by the shared bias correction b2s as the product with its correctly rounded reciprocal and one fma
 * correction, as adamw_avx512.h's adamw_denom (which says why that is the quotient), where the divider took one
 * of its three operations an element. Returns the elements done (a multiple of 8); the caller does the rest. */
static int64_t adamw8(const step_t *s, float *m, float *v, const float *g, float *d, int64_t cnt) {
    if (!(s->bias2_sqrt >= 0x1p-60f && s->bias2_sqrt <= 0x1p60f)) return 0;
    const __m256 w1 = _mm256_set1_ps(s->w1), w1_hi = _mm256_set1_ps(s->w1 - 1.0f), w2 = _mm256_set1_ps(s->w2);
    const __m256 beta2 = _mm256_set1_ps(s->beta2), eps = _mm256_set1_ps(s->eps);
    const __m256 b2s = _mm256_set1_ps(s->bias2_sqrt), y = _mm256_set1_ps(1.0f / s->bias2_sqrt);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 largest = _mm256_set1_ps(3.40282347e38f);
    const int lerp_low = fabsf(s->w1) < 0.5f, eps_before = s->eps_before;
    int64_t i = 0;
    for (; i + 8 <= cnt; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i), mv = _mm256_loadu_ps(m + i), diff = _mm256_sub_ps(gv, mv);
        const __m256 mn = lerp_low ? _mm256_fmadd_ps(w1, diff, mv) : _mm256_fmadd_ps(w1_hi, diff, gv);
        const __m256 vn = _mm256_fmadd_ps(_mm256_mul_ps(w2, gv), gv, _mm256_mul_ps(_mm256_loadu_ps(v + i), beta2));
        __m256 root = _mm256_sqrt_ps(vn);
        if (eps_before) root = _mm256_add_ps(root, eps);
        const __m256 q = _mm256_mul_ps(root, y);
        const __m256 q2 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, b2s, root), y, q);
        /* inf and NaN: q itself (the correction would make NaN of inf) */
        const __m256 special = _mm256_cmp_ps(_mm256_and_ps(root, magnitude), largest, _CMP_NLE_UQ);
        __m256 denom = _mm256_blendv_ps(q2, q, special);
        if (!eps_before) denom = _mm256_add_ps(denom, eps);
        _mm256_storeu_ps(m + i, mn);
        _mm256_storeu_ps(v + i, vn);
        _mm256_storeu_ps(d + i, _mm256_div_ps(mn, denom));
    }
    return i;
}
#endif

/* Elements [lo, hi) of the window, in tiles of `tile` elements from lo (lo a multiple of tile, so that the
 * tiles are the same whatever range a call is given). Returns 0, or -1 for a rule it does not know. */
static int step_range(step_t *s, int64_t tile, int64_t lo, int64_t hi) {
    const int state_free = s->rule >= RULE_FIRST_FREE;
    float mbuf[MAX_TILE], vbuf[MAX_TILE], d[MAX_TILE];
    const float w1 = s->w1, w2 = s->w2, beta2 = s->beta2, eps = s->eps, b2s = s->bias2_sqrt;
    /* an fp32 moment is read and written in place (each element read before it is written): no copies */
    const int m_fp32 = !state_free && s->codecs[0].kind == C_FP32;
    const int v_fp32 = s->rule == RULE_ADAMW && s->codecs[1].kind == C_FP32;
#ifdef __AVX512F__
    if (adamw16_applies(s)) lo = adamw16_range(s, tile, lo, hi, mbuf, vbuf);  /* the same bits (adamw_avx512.h) */
#endif
    for (int64_t t0 = lo; t0 < hi; t0 += tile) {
        const int64_t cnt = hi - t0 < tile ? hi - t0 : tile;
        float g[MAX_TILE];
        float *m = m_fp32 ? (float *)s->codecs[0].data + t0 : mbuf;
        float *v = v_fp32 ? (float *)s->codecs[1].data + t0 : vbuf;
        if (s->grad_dtype == D_FP32) memcpy(g, (const float *)s->grad + t0, (size_t)cnt * 4);
        else for (int64_t i = 0; i < cnt; i++) g[i] = bf16_to_f32(((const uint16_t *)s->grad)[t0 + i]);
        if (!state_free && !m_fp32) decode(&s->codecs[0], t0, cnt, m);
        if (s->rule == RULE_ADAMW) {
            if (!v_fp32) decode(&s->codecs[1], t0, cnt, v);
            int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
            i0 = adamw8(s, m, v, g, d, cnt);
#endif
            if (s->eps_before) {
                for (int64_t i = i0; i < cnt; i++) {
                    m[i] = lerp(m[i], g[i], w1);
                    v[i] = fmaf(w2 * g[i], g[i], v[i] * beta2);  /* addcmul_: fma(value * t1, t2, self) */
                    d[i] = m[i] / ((sqrtf(v[i]) + eps) / b2s);
                }
            } else {
                for (int64_t i = i0; i < cnt; i++) {
                    m[i] = lerp(m[i], g[i], w1);
                    v[i] = fmaf(w2 * g[i], g[i], v[i] * beta2);  /* addcmul_: fma(value * t1, t2, self) */
                    d[i] = m[i] / (sqrtf(v[i]) / b2s + eps);
                }
            }
        } else if (s->rule == RULE_LION) {
            for (int64_t i = 0; i < cnt; i++) {
                d[i] = sign(lerp(m[i], g[i], w1));
                m[i] = lerp(m[i], g[i], w2);
            }
        } else if (s->rule == RULE_SGDM) {
            for (int64_t i = 0; i < cnt; i++) {
                m[i] = m[i] * s->momentum + g[i];
                d[i] = m[i];
            }
        } else if (s->rule == RULE_NESTEROV) {  /* rules._nesterov: one momentum ahead, two roundings */
            for (int64_t i = 0; i < cnt; i++) {
                m[i] = m[i] * s->momentum + g[i];
                d[i] = m[i] * s->momentum + g[i];
            }
        } else if (s->rule == RULE_SIGN) {
            for (int64_t i = 0; i < cnt; i++) d[i] = sign(g[i]);  /* torch's sign: 0 for NaN, as for zero */
        } else if (s->rule == RULE_SGD) {
            memcpy(d, g, (size_t)cnt * 4);
        } else if (s->rule == RULE_LIFT_SIGN || s->rule == RULE_LIFT_SGD) {
            float r[MAX_TILE];  /* the residual -up + g (projectors.residual), then its free rule */
            if (s->g_dtype == D_FP32) memcpy(r, (const float *)s->g + t0, (size_t)cnt * 4);
            else for (int64_t i = 0; i < cnt; i++) r[i] = bf16_to_f32(((const uint16_t *)s->g)[t0 + i]);
            const float *up = s->up + t0, c = s->lift_coef, fs = s->free_scale;
            for (int64_t i = 0; i < cnt; i++) r[i] = -up[i] + r[i];
            if (s->rule == RULE_LIFT_SIGN) for (int64_t i = 0; i < cnt; i++) r[i] = sign(r[i]);
            for (int64_t i = 0; i < cnt; i++) d[i] = fmaf(r[i], fs, g[i] * c);  /* L.mul_(c).add_(free, fs) */
        } else {
            return -1;
        }
        if (s->direction_only) {
            memcpy((float *)s->param + t0, d, (size_t)cnt * 4);
        } else if (s->param_dtype == D_FP32) {
            float *p = (float *)s->param + t0;
            for (int64_t i = 0; i < cnt; i++) {
                float w = s->has_decay ? p[i] * s->decay : p[i];
                p[i] = fmaf(d[i], s->alpha, w);
            }
        } else if (s->rounding == W_NEAREST) {  /* decay rounded to bf16 (p.mul_), then the update */
            uint16_t *p = (uint16_t *)s->param + t0;
            for (int64_t i = 0; i < cnt; i++) {
                float w = bf16_to_f32(p[i]);
                if (s->has_decay) w = round_bf16(w * s->decay);
                p[i] = f32_to_bf16(fmaf(d[i], s->alpha, w));
            }
        } else {  /* the fp32 value (plus the compensation), decayed and updated in fp32, written once */
            uint16_t *p = (uint16_t *)s->param + t0;
            float y[MAX_TILE];
            for (int64_t i = 0; i < cnt; i++) {
                float w = bf16_to_f32(p[i]);
                if (s->rounding == W_KAHAN) w = w + bf16_to_f32(s->comp[t0 + i]);
                if (s->has_decay) w = w * s->decay;
                y[i] = fmaf(d[i], s->alpha, w);
            }
            if (s->rounding == W_KAHAN) {
                for (int64_t i = 0; i < cnt; i++) {
                    const uint16_t h = f32_to_bf16(y[i]);
                    p[i] = h;
                    s->comp[t0 + i] = f32_to_bf16(y[i] - bf16_to_f32(h));  /* exact in fp32 */
                }
            } else {
                stochastic_bf16(s->wkey0, s->wkey1, s->wcounter + t0, y, p, cnt);
            }
        }
        if (!state_free && !m_fp32) encode(&s->codecs[0], t0, cnt, m);
        if (s->rule == RULE_ADAMW && !v_fp32) encode(&s->codecs[1], t0, cnt, v);
    }
    return 0;
}

/* A part of a window's step for one thread: groups [g0, g1) of `group` elements each, run on its own copy of
 * the arguments (a factored moment's running row sum is per copy; its column sums go to the group's buffer). */
typedef struct {
    step_t s;
    int64_t tile, group, g0, g1;
    double *col_parts[2];  /* per factored codec: (groups of the round, cols) fp64 column sums, or NULL */
    int64_t round0;        /* the round's first group: group g's sums are row g - round0 of col_parts */
    int rc;
    int int8_bad;          /* step_group's */
} part_t;

static int step_group(step_t *s, int64_t tile, int64_t lo, int64_t hi, int *int8_bad);

static void *run_part(void *arg) {
    part_t *p = (part_t *)arg;
    p->rc = 0;
    for (int64_t g = p->g0; g < p->g1 && p->rc == 0; g++) {
        for (int k = 0; k < p->s.n_codecs; k++)
            if (p->col_parts[k] != NULL)
                p->s.codecs[k].col_sum = p->col_parts[k] + (g - p->round0) * p->s.codecs[k].cols;
        const int64_t lo = g * p->group, hi = lo + p->group < p->s.n ? lo + p->group : p->s.n;
        p->rc = step_group(&p->s, p->tile, lo, hi, &p->int8_bad);
    }
    return NULL;
}

/* elements: a thread's share is whole groups of about this many (a pool thread wakes in microseconds; a group
 * takes 50-100) */
#define GROUP_ELEMENTS 65536
#define MAX_THREADS 64
#define ROUND_GROUPS 16  /* groups a thread steps between two sums of a factored moment's column parts */

#ifdef _OPENMP
/* A process forked from one whose OpenMP pool had run has a pool of threads that no longer exist: libgomp waits on
 * them forever. There the kernel starts its own threads, as a build without OpenMP does. */
static volatile int forked_child = 0;
static void mark_forked_child(void) { forked_child = 1; }
__attribute__((constructor)) static void watch_fork(void) { pthread_atfork(NULL, NULL, mark_forked_child); }
#endif

/* fn(job t) for each t < threads, jobs an array of `threads` records of `size` bytes, each on a thread of its own.
 * Built with OpenMP, the threads of the process's OpenMP pool: torch's own where torch runs on libgomp (the
 * library is loaded once by its name), so no thread is started per call and none of torch's is left spinning on
 * the cores these need (docs/benchmarks.md, "The host step at a LLaMA-7B layer's shapes"). Otherwise, or in a
 * forked child, threads started here; one that cannot start leaves its job to this thread. */
static void run_on_threads(void *(*fn)(void *), void *jobs, size_t size, int64_t threads) {
    char *job = (char *)jobs;
#ifdef _OPENMP
    if (!forked_child) {
#pragma omp parallel for num_threads((int)threads) schedule(static, 1)
        for (int64_t t = 0; t < threads; t++) fn(job + t * size);
        return;
    }
#endif
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, fn, job + t * size) == 0;
    fn(job);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else fn(job + t * size);
    }
}

/* A round's column parts added into col_sum, group after group, over columns [c0, c1): each thread takes a slice of
 * the columns, every column's additions in group order as one thread's would be; the parts zeroed for the next */
typedef struct {
    double *sum;
    double *parts;  /* (groups, cols) */
    int64_t cols, c0, c1, groups;
} merge_t;

static void *run_merge(void *arg) {
    const merge_t *m = (const merge_t *)arg;
    for (int64_t g = 0; g < m->groups; g++) {
        double *part = m->parts + g * m->cols;
        for (int64_t c = m->c0; c < m->c1; c++) m->sum[c] += part[c];
        memset(part + m->c0, 0, sizeof(double) * (size_t)(m->c1 - m->c0));
    }
    return NULL;
}

#include "int8_weight.h"

/* Elements [lo, hi) of the window stepped, then, where the step writes int8 codes, the rows they complete (the
 * group holds whole rows: slimopt_elementwise_step); *int8_bad set where a row held a NaN or an infinity (or no
 * buffer could be had: the caller writes the codes). Returns step_range's code. */
static int step_group(step_t *s, int64_t tile, int64_t lo, int64_t hi, int *int8_bad) {
    const int rc = step_range(s, tile, lo, hi);
    if (rc != 0 || s->int8 == NULL || *int8_bad) return rc;
    int8q_part_t rows = {s->int8, lo / s->int8->cols, hi / s->int8->cols, 0};
    int8q_rows(&rows);
    *int8_bad = rows.rc != 0;
    return rc;
}

/* The step of one window. Returns 0, or -1 for arguments it does not know (or memory it could not get).
 *
 * With s->threads > 1 the window is cut into groups of whole tiles (and, for a factored moment, whole rows), at
 * the same places whatever the thread count, and each thread steps a run of consecutive groups. A factored
 * moment's column sums are added group by group into buffers of their own and then into col_sum in group
 * order, so the result is the same bits at any thread count; every other codec's block is whole in one tile and
 * its random numbers are drawn by element index. */
int slimopt_elementwise_step(step_t *s) {
    s->int8_written = 0;
    if (!trits_ready) {
#ifdef __AVX512F__
        init_trit_lanes();
#endif
        init_trits();
    }
    const int state_free = s->rule >= RULE_FIRST_FREE;
    if (s->n_codecs < (state_free ? 0 : 1) || s->n_codecs > (state_free ? 0 : 2)) return -1;
    int64_t align = 1;  /* a tile holds whole blocks of every codec (and whole bytes of five trits) */
    for (int k = 0; k < s->n_codecs; k++) {
        int64_t a = s->codecs[k].block;
        if (s->codecs[k].kind == C_TERNARY_SR || s->codecs[k].kind == C_TERNARY_EF) a = a / gcd(a, 5) * 5;
        align = align / gcd(align, a) * a;
    }
    if (align > MAX_TILE) return -1;
    if (s->n <= 0) return 0;  /* an empty window: a rank's empty shard */
    float pairs[2][256 * 2];
    for (int k = 0; k < s->n_codecs; k++) {
        codec_t *c = &s->codecs[k];
        if (c->kind != C_BLOCK4) continue;
        for (int b = 0; b < 256; b++) { pairs[k][2 * b] = c->qmap[b >> 4]; pairs[k][2 * b + 1] = c->qmap[b & 15]; }
        c->pairs = pairs[k];
    }
    const int64_t tile = align * (MAX_TILE / 16 > align ? MAX_TILE / 16 / align : 1);
    /* a group: whole tiles and whole rows of every factored moment and of the int8 weight, about GROUP_ELEMENTS */
    int64_t unit = tile;
    int factored = 0;
    for (int k = 0; k < s->n_codecs; k++)
        if (s->codecs[k].kind == C_FACTORED) {
            unit = unit / gcd(unit, s->codecs[k].cols) * s->codecs[k].cols;
            factored = 1;
        }
    if (s->int8 != NULL) {
        const int8q_t *q = s->int8;
        if (s->direction_only || q->rows * q->cols != s->n || q->w != s->param || q->w_dtype != s->param_dtype
            || q->group < 0 || q->stochastic)
            return -1;
        unit = unit / gcd(unit, q->cols) * q->cols;
    }
    const int64_t group = unit * (GROUP_ELEMENTS > unit ? GROUP_ELEMENTS / unit : 1);
    const int64_t groups = (s->n + group - 1) / group;
    int64_t threads = s->threads < 1 ? 1 : s->threads > MAX_THREADS ? MAX_THREADS : s->threads;
    if (threads > groups) threads = groups > 1 ? groups : 1;  /* an empty window (a rank's empty shard) too */
    if (!factored && s->int8 == NULL && threads == 1) return step_range(s, tile, 0, s->n);
    int int8_bad = 0;

    /* one thread: a group's column sums in one buffer, added into col_sum before the next group. Several: rounds
     * of ROUND_GROUPS groups a thread, each group's sums in a buffer of its own, added into col_sum in group order
     * after the round. The same sums in the same order either way, in a buffer of bounded size. */
    const int64_t per_round = factored ? threads * ROUND_GROUPS : groups;
    const int64_t buffered = threads == 1 ? 1 : per_round < groups ? per_round : groups;
    double *parts[2] = {NULL, NULL};
    for (int k = 0; k < s->n_codecs; k++) {
        if (s->codecs[k].kind != C_FACTORED) continue;
        parts[k] = (double *)calloc((size_t)(buffered * s->codecs[k].cols), sizeof(double));
        if (parts[k] == NULL) { free(parts[0]); return -1; }
    }
    int rc = 0;
    if (threads == 1) {
        step_t one = *s;  /* its own running row sums, as a thread's copy */
        for (int64_t g = 0; g < groups && rc == 0; g++) {
            for (int k = 0; k < s->n_codecs; k++)
                if (parts[k] != NULL) {
                    memset(parts[k], 0, sizeof(double) * (size_t)s->codecs[k].cols);
                    one.codecs[k].col_sum = parts[k];
                }
            const int64_t lo = g * group, hi = lo + group < s->n ? lo + group : s->n;
            rc = step_group(&one, tile, lo, hi, &int8_bad);
            for (int k = 0; k < s->n_codecs; k++)
                if (parts[k] != NULL)
                    for (int64_t c = 0; c < s->codecs[k].cols; c++) s->codecs[k].col_sum[c] += parts[k][c];
        }
    }
    for (int64_t r0 = 0; threads > 1 && r0 < groups && rc == 0; r0 += per_round) {
        const int64_t r1 = r0 + per_round < groups ? r0 + per_round : groups;
        part_t jobs[MAX_THREADS];
        for (int64_t t = 0; t < threads; t++) {
            jobs[t].s = *s;
            jobs[t].tile = tile;
            jobs[t].group = group;
            jobs[t].g0 = r0 + (r1 - r0) * t / threads;
            jobs[t].g1 = r0 + (r1 - r0) * (t + 1) / threads;
            jobs[t].col_parts[0] = parts[0];
            jobs[t].col_parts[1] = parts[1];
            jobs[t].round0 = r0;
            jobs[t].rc = 0;
            jobs[t].int8_bad = 0;
        }
        run_on_threads(run_part, jobs, sizeof jobs[0], threads);
        for (int64_t t = 0; t < threads; t++) {
            rc = rc != 0 ? rc : jobs[t].rc;
            int8_bad |= jobs[t].int8_bad;
        }
        for (int k = 0; k < s->n_codecs; k++) {
            if (parts[k] == NULL) continue;
            merge_t merges[MAX_THREADS];
            const int64_t cols = s->codecs[k].cols;
            for (int64_t t = 0; t < threads; t++)
                merges[t] = (merge_t){s->codecs[k].col_sum, parts[k], cols, cols * t / threads,
                                      cols * (t + 1) / threads, r1 - r0};
            run_on_threads(run_merge, merges, sizeof merges[0], threads);
        }
    }
    free(parts[0]);
    free(parts[1]);
    s->int8_written = s->int8 != NULL && rc == 0 && !int8_bad;
    return rc;
}

/* TACO's candidate search with one candidate a column (taco._window_candidates at kc = 1): for each column of
 * the (m, n) row-major gradient g, the row of largest |g| among the rows not hidden (hidden[c], or -1 for none),
 * the smaller row on ties, as torch's argmax takes the first maximum. |g| is compared as its int32 bit pattern
 * (non-negative floats order like their patterns); every NaN becomes the canonical pattern above +inf, so the
 * first NaN wins, as argmax's does; a hidden entry is -1, below every value. Writes rows[c] and absval[c]: |g| at
 * that row, or -1 where no valid candidate (a NaN, or every row hidden). keys: (n,) scratch. */
int slimopt_column_best(const void *g, int32_t dtype, int64_t m, int64_t n, const int64_t *hidden, int64_t *rows,
                        float *absval, int32_t *keys) {
    if (m < 1 || (dtype != D_FP32 && dtype != D_BF16)) return -1;
    for (int64_t r = 0; r < m; r++) {
        int32_t k[MAX_TILE];
        for (int64_t c0 = 0; c0 < n; c0 += MAX_TILE) {
            const int64_t len = n - c0 < MAX_TILE ? n - c0 : MAX_TILE;
            if (dtype == D_FP32) {
                const int32_t *src = (const int32_t *)g + r * n + c0;
                for (int64_t i = 0; i < len; i++) k[i] = src[i] & 0x7FFFFFFF;
            } else {
                const uint16_t *src = (const uint16_t *)g + r * n + c0;
                for (int64_t i = 0; i < len; i++) k[i] = ((int32_t)src[i] << 16) & 0x7FFFFFFF;
            }
            for (int64_t i = 0; i < len; i++) k[i] = k[i] > 0x7F800000 ? 0x7FC00000 : k[i];
            if (hidden != NULL)
                for (int64_t i = 0; i < len; i++) k[i] = hidden[c0 + i] == r ? -1 : k[i];
            int32_t *best = keys + c0;
            int64_t *at = rows + c0;
            if (r == 0) {
                for (int64_t i = 0; i < len; i++) { best[i] = k[i]; at[i] = 0; }
                continue;
            }
            for (int64_t i = 0; i < len; i++) {
                const int take = k[i] > best[i];
                best[i] = take ? k[i] : best[i];
                at[i] = take ? r : at[i];
            }
        }
    }
    for (int64_t c = 0; c < n; c++) {
        const int32_t b = keys[c];
        float f;
        memcpy(&f, &b, 4);
        absval[c] = (b >= 0 && b <= 0x7F800000) ? f : -1.0f;
    }
    return 0;
}

/* TACO's whole step at one stored component a column (taco.sparse_update then taco.apply_sparse, k = 1, the
 * weight rounded to nearest), with the same arithmetic op for op: decode the stored component, its EMA with the
 * gradient at its row, the best other row (slimopt_column_best), the larger of the two kept, re-encoded, and the
 * weight decayed and moved at the kept row by -lr c sign. One pass over the gradient (the search) and one over
 * the weight (the decay) instead of some thirty small tensor operations a weight. */
typedef struct {
    int64_t m, n;
    const void *g;            /* (m, n) D_FP32 / D_BF16, row-major */
    int32_t g_dtype;
    void *rows;               /* (n,) the stored rows: uint8, int16, int32 or int64 (rows_bytes 1, 2, 4, 8) */
    int32_t rows_bytes;
    void *codes;              /* (n,) int8 codes, or float8_e4m3fn ones (fp8) */
    int32_t fp8;
    const float *fp8_values;  /* (256,) every fp8 code's value (fp8 only) */
    void *absmax;             /* (n,) the column scales: fp32, or bf16 where scale_bf16 */
    int32_t scale_bf16;
    float top;                /* the largest code: 448 (fp8) or 127 (int8) */
    float beta, w;            /* the decay of the history, and (float)(1 - beta) */
    void *param;              /* (m, n) D_FP32 / D_BF16: decayed, then moved at the kept rows */
    int32_t param_dtype;
    int32_t has_decay;
    float decay;              /* 1 - lr * weight_decay */
    float alpha;              /* -lr * c */
    int64_t *out_rows;        /* (n,) the kept rows */
    float *out_values;        /* (n,) the kept values (fp32, before encoding) */
    float *out_signs;         /* (n,) the direction's sign at the kept row */
    int64_t *hidden;          /* (n,) scratch: the stored row of a live column, else -1 */
    int64_t *cand_rows;       /* (n,) scratch */
    float *cand_abs;          /* (n,) scratch */
    int32_t *keys;            /* (n,) scratch */
    /* a row shard (FSDP2): g and param hold rows [row0, row0 + m) of a weight whose stored rows are global */
    int64_t row0;
    int64_t *shard_keys;      /* (2, n) int64: what slimopt_taco_shard_keys writes and slimopt_taco_shard_step reads */
} taco_t;

static inline float g_at(const taco_t *t, int64_t r, int64_t c) {
    const int64_t i = r * t->n + c;
    return t->g_dtype == D_FP32 ? ((const float *)t->g)[i] : bf16_to_f32(((const uint16_t *)t->g)[i]);
}

static inline int64_t stored_row(const taco_t *t, int64_t c) {
    switch (t->rows_bytes) {
    case 1: return ((const uint8_t *)t->rows)[c];
    case 2: return ((const int16_t *)t->rows)[c];
    case 4: return ((const int32_t *)t->rows)[c];
    default: return ((const int64_t *)t->rows)[c];
    }
}

static inline void store_row(const taco_t *t, int64_t c, int64_t r) {
    switch (t->rows_bytes) {
    case 1: ((uint8_t *)t->rows)[c] = (uint8_t)r; break;
    case 2: ((int16_t *)t->rows)[c] = (int16_t)r; break;
    case 4: ((int32_t *)t->rows)[c] = (int32_t)r; break;
    default: ((int64_t *)t->rows)[c] = r;
    }
}

/* The stored component of column c decoded (taco.decode at k = 1). */
static inline float stored_value(const taco_t *t, int64_t c) {
    const float code = t->fp8 ? t->fp8_values[((const uint8_t *)t->codes)[c]] : (float)((const int8_t *)t->codes)[c];
    const float scale = t->scale_bf16 ? bf16_to_f32(((const uint16_t *)t->absmax)[c]) : ((const float *)t->absmax)[c];
    return code * (scale / t->top);
}

/* fp32 -> float8_e4m3fn, round to nearest even, for |x| <= 448 and not NaN (what the encode gives it): normal
 * values keep 3 of the 23 mantissa bits, rounded on the integer pattern; below 2^-6 the code is the number of
 * 2^-9 steps (subnormals, and 8 for the smallest normal). */
static inline uint8_t fp8_e4m3fn(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    const uint32_t a = bits & 0x7FFFFFFFu;
    if (a < (121u << 23)) return sign | (uint8_t)nearbyintf(fabsf(x) * 512.0f);
    const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
    return sign | (uint8_t)((r >> 20) - (120u << 3));
}

static void keep_and_move(const taco_t *t, float *stored, int64_t row0, int64_t m);

/* Returns 0; 1 where a kept value is NaN (nothing written: the caller encodes and applies it as the eager step
 * does, from out_rows and out_values); -1 for arguments it does not know. */
int slimopt_taco_one(const taco_t *t) {
    const int64_t m = t->m, n = t->n;
    if (m < 1 || n < 1 || (t->g_dtype != D_FP32 && t->g_dtype != D_BF16)) return -1;
    if (t->param_dtype != D_FP32 && t->param_dtype != D_BF16) return -1;
    float *stored = t->out_values;  /* the stored components' values, until step 4 overwrites them */
    for (int64_t c = 0; c < n; c++) {  /* 1-2. decode; the EMA of the live ones at their row */
        const float v = stored_value(t, c);
        const int64_t r = stored_row(t, c);
        const int live = v != 0.0f;
        stored[c] = live ? fmaf(g_at(t, r, c), t->w, v * t->beta) : 0.0f;
        t->hidden[c] = live ? r : -1;
    }
    /* 3. the best row not stored */
    int rc = slimopt_column_best(t->g, t->g_dtype, m, n, t->hidden, t->cand_rows, t->cand_abs, t->keys);
    if (rc != 0) return rc;
    int nan = 0;
    for (int64_t c = 0; c < n; c++) {  /* 4. the larger |value| kept (taco._keep_larger) */
        const int valid = t->cand_abs[c] >= 0.0f;
        const float cv = valid ? g_at(t, t->cand_rows[c], c) * t->w : 0.0f;
        const float sa = fabsf(stored[c]), ca = fabsf(cv);
        const int take = (ca > sa) | ((ca != ca) & (sa == sa));
        t->out_rows[c] = take ? t->cand_rows[c] : stored_row(t, c);
        stored[c] = take ? cv : stored[c];
        nan |= stored[c] != stored[c];
    }
    if (nan) return 1;
    keep_and_move(t, stored, 0, m);
    return 0;
}

/* Steps 5-6 and apply_sparse of a step whose kept rows (out_rows, global) and values (stored) are known: the sign,
 * the store (taco._encode at k = 1), the decay of the rows [row0, row0 + m) that p holds and the move of the kept
 * entries among them. */
static void keep_and_move(const taco_t *t, float *stored, int64_t row0, int64_t m) {
    const int64_t n = t->n;
    const float tiny = 1.17549435e-38f;
    for (int64_t c = 0; c < n; c++) {  /* 5-6. the sign, and the store (taco._encode at k = 1) */
        const float v = stored[c];
        t->out_signs[c] = sign(v);
        float scale = fabsf(v);
        if (t->scale_bf16) {
            const uint16_t h = f32_to_bf16(scale);
            ((uint16_t *)t->absmax)[c] = h;
            scale = bf16_to_f32(h);
        } else {
            ((float *)t->absmax)[c] = scale;
        }
        float normed = scale > 0.0f ? v / (scale > tiny ? scale : tiny) : 0.0f;
        normed = normed < -1.0f ? -1.0f : normed > 1.0f ? 1.0f : normed;
        normed = normed * t->top;
        if (t->fp8) ((uint8_t *)t->codes)[c] = fp8_e4m3fn(normed);
        else ((int8_t *)t->codes)[c] = (int8_t)nearbyintf(normed);
        store_row(t, c, t->out_rows[c]);
    }
    /* apply_sparse: the decay over the whole weight (its rows here), then the kept entries it holds */
    const int64_t total = m * n;
    if (t->param_dtype == D_FP32) {
        float *p = (float *)t->param;
        if (t->has_decay) for (int64_t i = 0; i < total; i++) p[i] = p[i] * t->decay;
        for (int64_t c = 0; c < n; c++) {
            const int64_t r = t->out_rows[c] - row0;
            if (r < 0 || r >= m) continue;
            float *e = p + r * n + c;
            *e = fmaf(t->out_signs[c], t->alpha, *e);
        }
    } else {
        uint16_t *p = (uint16_t *)t->param;
        if (t->has_decay) for (int64_t i = 0; i < total; i++) p[i] = f32_to_bf16(bf16_to_f32(p[i]) * t->decay);
        for (int64_t c = 0; c < n; c++) {
            const int64_t r = t->out_rows[c] - row0;
            if (r < 0 || r >= m) continue;
            uint16_t *e = p + r * n + c;
            *e = f32_to_bf16(fmaf(t->out_signs[c], t->alpha, bf16_to_f32(*e)));
        }
    }
}

/* TACO at one component a column on a row shard (sharded_taco.local_keys, finish_k1, apply_local): the shard
 * holds rows [row0, row0 + m) of g and param (m may be 0); the stored rows are global. Order-preserving int64
 * keys, non-negative, whose MAX over the ranks the caller all-reduces between the two calls (as float64, whose
 * order they keep: sharded_taco's _SHIFT):
 *   keys[c]     = |g| bits << 32 | (2^31 - 1 - global row) << 1 | sign bit, of this shard's best candidate of
 *                 column c (the stored row hidden where the shard holds it), or 0 (sharded_taco.pack_keys);
 *   keys[n + c] = the gradient at the stored row, where the shard holds it and the component is live, as an
 *                 order-preserving key of the float (sharded_taco._float_keys) plus 2^31 + 1, else 0. */
#define TACO_SHIFT (((int64_t)1 << 31) + 1)
static inline int64_t float_key(float x) {
    int32_t b;
    memcpy(&b, &x, 4);
    return (int64_t)(b ^ ((b >> 31) & 0x7FFFFFFF));
}

static inline float key_float(int64_t k) {
    const int32_t b = (int32_t)(k ^ ((k >> 31) & 0x7FFFFFFF));
    float x;
    memcpy(&x, &b, 4);
    return x;
}

int slimopt_taco_shard_keys(const taco_t *t) {
    const int64_t m = t->m, n = t->n, row0 = t->row0;
    if (m < 0 || n < 1 || (t->g_dtype != D_FP32 && t->g_dtype != D_BF16)) return -1;
    int64_t *keys = t->shard_keys;
    for (int64_t c = 0; c < n; c++) {
        const int64_t r = stored_row(t, c) - row0;
        const int mine = stored_value(t, c) != 0.0f && r >= 0 && r < m;
        t->hidden[c] = mine ? r : -1;
        keys[n + c] = mine ? float_key(g_at(t, r, c)) + TACO_SHIFT : 0;
        keys[c] = 0;
    }
    if (m == 0) return 0;
    int rc = slimopt_column_best(t->g, t->g_dtype, m, n, t->hidden, t->cand_rows, t->cand_abs, t->keys);
    if (rc != 0) return rc;
    for (int64_t c = 0; c < n; c++) {
        if (!(t->cand_abs[c] >= 0.0f)) continue;
        const float v = g_at(t, t->cand_rows[c], c);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        const int64_t abits = (int64_t)(bits & 0x7FFFFFFFu), negative = (int64_t)(bits >> 31);
        keys[c] = (abits << 32) | ((((int64_t)1 << 31) - 1 - (t->cand_rows[c] + row0)) << 1) | negative;
    }
    return 0;
}

/* The rest of the step from the keys MAX-reduced over the ranks: every rank keeps and stores the same component
 * (sharded_taco.finish_k1) and decays and moves its own rows (apply_local). Returns 1 where a kept value is NaN
 * (nothing written: the caller takes the tensor operations), 0 otherwise. */
int slimopt_taco_shard_step(const taco_t *t) {
    const int64_t n = t->n;
    if (n < 1 || (t->param_dtype != D_FP32 && t->param_dtype != D_BF16)) return -1;
    const int64_t *keys = t->shard_keys;
    float *stored = t->out_values;
    int nan = 0;
    for (int64_t c = 0; c < n; c++) {
        const float v = stored_value(t, c);
        const int live = v != 0.0f;
        const float s = live ? fmaf(key_float(keys[n + c] - TACO_SHIFT), t->w, v * t->beta) : 0.0f;  /* 2. EMA */
        const int64_t k = keys[c];
        const int valid = k > 0;
        float cv = 0.0f;
        int64_t cr = 0;
        if (valid) {  /* unpack_keys: the candidate's signed value and global row */
            int32_t abits = (int32_t)(k >> 32);
            float a;
            memcpy(&a, &abits, 4);
            cv = ((k & 1) ? -a : a) * t->w;
            cr = (((int64_t)1 << 31) - 1) - ((k >> 1) & ((((int64_t)1) << 31) - 1));
        }
        const float sa = fabsf(s), ca = fabsf(cv);  /* 4. the larger kept (taco._keep_larger) */
        const int take = (ca > sa) | ((ca != ca) & (sa == sa));
        t->out_rows[c] = take ? cr : stored_row(t, c);
        stored[c] = take ? cv : s;
        nan |= stored[c] != stored[c];
    }
    if (nan) return 1;
    keep_and_move(t, stored, t->row0, t->m);
    return 0;
}

