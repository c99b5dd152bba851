/* Symmetric int8 weights written from a higher-precision copy: slimopt/optim/algorithm/int8_weight.quantize in one
 * pass a row (its reference; tests/test_int8_native.py holds the two to the same bytes).
 *
 * Included by elementwise_step.c before a window's step, which may write a weight's codes rows at a time as it goes
 * (step_t.int8: the rows read again while in cache, not from memory). Per row, or per group of `group`
 * consecutive elements of a row (the last group may be short): scale = absmax / 127 (an fp32 division); code =
 * w / max(scale, smallest normal) (correctly rounded, as the reference's division, so the absmax element lands on
 * exactly +-127), rounded to nearest (ties to even) or stochastically (floor(x + u), u the counter stream's number
 * of the element's row-major index), clamped to [-127, 127]. Rows are split over threads; no row depends on another,
 * so the bytes do not depend on the thread count. A NaN or an infinity in the weight returns 1 with nothing promised:
 * the caller takes the reference, whose conversions of those are torch's to define.
 */

typedef struct int8q {
    int64_t rows, cols, group; /* group 0: one scale per row */
    const void *w;             /* (rows, cols) row-major, D_FP32 or D_BF16 */
    int32_t w_dtype;
    int8_t *codes;             /* (rows, cols) */
    float *scales;             /* (rows, groups) */
    int32_t stochastic;        /* 0: nearest; 1: from the stream below */
    uint32_t key0, key1;       /* the stream's key words */
    int64_t counter;           /* the counter of element (0, 0); element (r, c) draws counter + r cols + c */
    int32_t threads;
} int8q_t;

typedef struct {
    const int8q_t *q;
    int64_t r0, r1;
    int rc;
} int8q_part_t;

/* elements [c0, c0 + n) of row r of a bf16 weight as fp32 into out */
static void int8q_load(const int8q_t *q, int64_t r, int64_t c0, int64_t n, float *out) {
    const uint16_t *w = (const uint16_t *)q->w + r * q->cols + c0;
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(w[i]);
}

/* One group of n values x (fp32) of row r from column c0: its scale stored, its codes written. Returns 1 at a
 * NaN or an infinity. With AVX-512 the division by the scale is adamw_avx512.h's: the reciprocal and one fma
 * correction, the correctly rounded quotient, where block_divisor finds every element in its range (the
 * divider's bits; a vdivps a register had bound this pass). */
static int int8q_group(const int8q_t *q, int64_t r, int64_t c0, const float *x, int64_t n, int64_t g) {
    uint32_t top = 0;  /* |x| as patterns: their max is the absmax; NaN and inf lie at or above 0x7F800000 */
    uint32_t low = 0xFFFFFFFFu;  /* the smallest nonzero pattern less one (block_magnitudes') */
    int64_t i = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        __m512i top16, low16;
        block_magnitudes(x, n / 16 * 16, &top16, &low16);
        top = (uint32_t)_mm512_reduce_max_epi32(top16);
        low = _mm512_reduce_min_epu32(low16);
        i = n / 16 * 16;
    }
#endif
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        u &= 0x7FFFFFFFu;
        top = u > top ? u : top;
        low = u - 1 < low ? u - 1 : low;
    }
    if (top >= 0x7F800000u) return 1;
    float amax;
    memcpy(&amax, &top, 4);
    const float scale = amax / 127.0f;
    const int64_t groups = q->group == 0 ? 1 : (q->cols + q->group - 1) / q->group;
    q->scales[r * groups + g] = scale;
    const float d = scale < 1.17549435e-38f ? 1.17549435e-38f : scale;
#ifdef __AVX512F__
    const block_div_t bd = block_divisor(scale, (int32_t)top, low);
    const __m512 dv = _mm512_set1_ps(bd.div), yv = _mm512_set1_ps(bd.recip), lowv = _mm512_set1_ps(bd.low);
#else
    (void)low;
#endif
    int8_t *out = q->codes + r * q->cols + c0;
    float u[MAX_TILE];
    for (int64_t s0 = 0; s0 < n; s0 += MAX_TILE) {
        const int64_t len = n - s0 < MAX_TILE ? n - s0 : MAX_TILE;
        if (q->stochastic) uniform_many(q->key0, q->key1, q->counter + r * q->cols + c0 + s0, u, len);
        i = 0;
#ifdef __AVX512F__
        const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        for (; i + 16 <= len && !q->stochastic; i += 16) {
            /* |w / d| <= 127 (1 + 2^-23) for a finite weight, whose nearest integer the clamp would not move: the
             * conversion rounds, the saturating narrowing stands in for the clamp */
            const __m512 v = normalize16(bd.how, _mm512_loadu_ps(x + s0 + i), dv, yv, lowv);
            const __m512i k = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(out + s0 + i), _mm512_cvtsepi32_epi8(k));
        }
        for (; i + 16 <= len; i += 16) {
            __m512 v = normalize16(bd.how, _mm512_loadu_ps(x + s0 + i), dv, yv, lowv);
            v = _mm512_roundscale_ps(_mm512_add_ps(v, _mm512_loadu_ps(u + i)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            _mm_storeu_si128((__m128i *)(out + s0 + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
        }
#endif
        for (; i < len; i++) {
            float v = x[s0 + i] / d;
            v = q->stochastic ? floorf(v + u[i]) : nearbyintf(v);  /* the default rounding mode: ties to even */
            v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
            out[s0 + i] = (int8_t)v;
        }
    }
    return 0;
}

static void *int8q_rows(void *arg) {
    int8q_part_t *p = (int8q_part_t *)arg;
    const int8q_t *q = p->q;
    const int64_t width = q->group == 0 ? q->cols : q->group;
    /* bf16 weights as fp32 into a buffer; fp32 ones read where they are */
    float *x = q->w_dtype == D_FP32 ? NULL : (float *)malloc(sizeof(float) * (size_t)width);
    p->rc = q->w_dtype != D_FP32 && x == NULL ? -1 : 0;
    for (int64_t r = p->r0; r < p->r1 && p->rc == 0; r++)
        for (int64_t c0 = 0, g = 0; c0 < q->cols && p->rc == 0; c0 += width, g++) {
            const int64_t n = q->cols - c0 < width ? q->cols - c0 : width;
            const float *values = x;
            if (x == NULL) values = (const float *)q->w + r * q->cols + c0;
            else int8q_load(q, r, c0, n, x);
            p->rc = int8q_group(q, r, c0, values, n, g);
        }
    free(x);
    return NULL;
}

/* Returns 0; 1 where the weight holds a NaN or an infinity (take the reference); -1 for arguments it does not know
 * or memory it could not get. */
int slimopt_quantize_int8(const int8q_t *q) {
    if (q->rows < 0 || q->cols < 1 || q->group < 0 || (q->w_dtype != D_FP32 && q->w_dtype != D_BF16)) return -1;
    int64_t threads = q->threads < 1 ? 1 : q->threads > MAX_THREADS ? MAX_THREADS : q->threads;
    const int64_t numel = q->rows * q->cols;
    if (threads > numel / GROUP_ELEMENTS) threads = numel / GROUP_ELEMENTS > 1 ? numel / GROUP_ELEMENTS : 1;
    if (threads > q->rows) threads = q->rows > 1 ? q->rows : 1;
    int8q_part_t parts[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        parts[t] = (int8q_part_t){q, q->rows * t / threads, q->rows * (t + 1) / threads, 0};
    run_on_threads(int8q_rows, parts, sizeof parts[0], threads);
    int rc = 0;
    for (int64_t t = 0; t < threads; t++) rc = rc != 0 ? rc : parts[t].rc;
    return rc;
}
