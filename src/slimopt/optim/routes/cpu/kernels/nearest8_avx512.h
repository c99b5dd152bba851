/* The 8-bit nearest code without a gather: count(points <= x) of a 255-point map's decisions, 64 values at a time.
 *
 * A gather from the range table (codes16_table) is slow on AMD's Zen 4 and Zen 5 (docs/benchmarks.md, "On AMD
 * Zen 5: the 8-bit code without a gather"). Here the count comes from the map's shape instead: the dynamic
 * maps (arXiv 2110.02861) put their points on a linear grid per decade, so within a binade of |x| (or the part of
 * it on one side of a decade's edge) a line gives the count up to one: c0 = trunc(fma(|x|, k, o)), with
 * count - 1 <= c0 <= count. One look-up of the point c0 (map256_t's byte permutes, 64 values at a time) and a
 * comparison give the count. The lines are fitted once per map and proved before use: c0 and the count are both
 * monotone within a segment, so checking the ends of every interval between two points checks every float.
 * A map the proof rejects keeps the gather. Negative x counts on the mirrored points (the negatives' decisions
 * negated, each moved up one ulp so that "<" becomes "<="), and |x| >= 1, inf and NaN take the count of the largest
 * float below 1: every point lies in (-1, 1), so that is the count of every point above or below, as the table's.
 */

#ifdef __AVX512VBMI__

typedef struct {
    float split[32];    /* by exponent field mod 32: |x| >= split takes the binade's second segment */
    int32_t seg[32];    /* by exponent field mod 32: the binade's first segment */
    float k[32], o[32]; /* by segment: c0 = trunc(fma(|x|, k, o)) */
    float side[256];    /* the points c0 indexes: positives (0..127) and mirrored negatives (128..), +inf padded */
    uint8_t side_planes[4][4][64]; /* side as map256 byte planes: loaded, not rebuilt, at every call */
    int32_t n_neg;      /* points below zero */
    int32_t mirrored;   /* 1: negative x looks up side[128 + c0]; 0: every point is positive, negative x counts 0 */
    int32_t e_low;      /* the exponent field every |x| below the smallest point is raised to (segment 0: c0 = 0) */
} nearest8_t;

/* trunc(fma(a, k, o)) for |x| = a in [0, 1), as the registers compute it; -1000 where the float leaves int range */
static int32_t nearest8_estimate(const nearest8_t *t, float a) {
    uint32_t bits;
    memcpy(&bits, &a, 4);
    int32_t f = (int32_t)(bits >> 23);
    f = f > t->e_low ? f : t->e_low;
    const int32_t seg = t->seg[f % 32] + (a >= t->split[f % 32]);
    const float g = fmaf(a, t->k[seg], t->o[seg]);
    return g > -2.0f && g < 1000.0f ? (int32_t)g : -1000;
}

/* The proof for one side (points q, n of them, ascending in (0, 1)): at both ends of every interval on which the
 * count is constant (cut at the segments' edges too), count - 1 <= c0 <= count and c0 < limit. */
static int nearest8_proves(const nearest8_t *t, const float *q, int32_t n, int32_t limit) {
    float cuts[1 + 2 * 32 + 256 + 1];  /* zero, each binade and its split, the points, one */
    int32_t m = 0;
    cuts[m++] = 0.0f;
    for (int32_t f = t->e_low + 1; f <= 126; f++) {
        const float lo = ldexpf(1.0f, f - 127);
        cuts[m++] = lo;
        if (t->split[f % 32] < 2 * lo) cuts[m++] = t->split[f % 32];
    }
    for (int32_t j = 0; j < n; j++) cuts[m++] = q[j];
    cuts[m++] = 1.0f;
    for (int32_t i = 1; i < m; i++)  /* insertion sort: a few hundred values, once per map */
        for (int32_t j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
            const float s = cuts[j];
            cuts[j] = cuts[j - 1];
            cuts[j - 1] = s;
        }
    for (int32_t i = 0; i + 1 < m; i++) {
        if (!(cuts[i] < cuts[i + 1])) continue;
        const float ends[2] = {cuts[i], nextafterf(cuts[i + 1], 0.0f)};
        int32_t count = 0;
        while (count < n && q[count] <= ends[0]) count++;
        for (int e = 0; e < 2; e++) {
            const int32_t c0 = nearest8_estimate(t, ends[e]);
            if (c0 < count - 1 || c0 > count || c0 < 0 || c0 >= limit) return 0;
        }
    }
    return 1;
}

/* Segment s: the line through points [j0, j1] of q (count j + 1 at point j; the line puts it at j + 0.5, centred
 * over the points), or the constant j0 where it holds at most one point */
static void nearest8_line(nearest8_t *t, int32_t s, const float *q, int32_t j0, int32_t j1, int32_t below) {
    if (j1 <= j0) {
        t->k[s] = 0.0f;
        t->o[s] = (float)below + 0.5f;
        return;
    }
    const double k = (double)(j1 - j0) / ((double)q[j1] - (double)q[j0]);
    double lo = 1e30, hi = -1e30;
    for (int32_t j = j0; j <= j1; j++) {
        const double r = j + 0.5 - k * q[j];
        lo = r < lo ? r : lo;
        hi = r > hi ? r : hi;
    }
    t->k[s] = (float)k;
    t->o[s] = (float)((lo + hi) / 2);
}

/* The lines of a map whose 255 decision points are p (ascending), and their proof: 1 where the search may be used */
static int nearest8_fit(nearest8_t *t, const float *p, int32_t n) {
    memset(t, 0, sizeof *t);
    int32_t n_neg = 0;
    for (int32_t j = 0; j < n; j++) {
        if (!(fabsf(p[j]) < 1.0f) || p[j] == 0.0f || (j > 0 && !(p[j - 1] < p[j]))) return 0;
        n_neg += p[j] < 0.0f;
    }
    const int32_t n_pos = n - n_neg;
    t->n_neg = n_neg;
    t->mirrored = n_neg > 0;
    if (t->mirrored ? n_pos > 128 || n_neg > 128 : n > 255) return 0;
    float *pos = t->side, *neg = t->side + 128;
    for (int32_t j = 0; j < 256; j++) t->side[j] = INFINITY;
    for (int32_t j = 0; j < n_pos; j++) pos[j] = p[n_neg + j];
    for (int32_t j = 0; j < n_neg; j++) neg[j] = nextafterf(-p[n_neg - 1 - j], INFINITY);
    uint32_t low_bits;
    const float lowest = t->mirrored && neg[0] < pos[0] ? neg[0] : pos[0];
    memcpy(&low_bits, &lowest, 4);
    t->e_low = (int32_t)(low_bits >> 23) - 1;
    if (t->e_low < 126 - 31) return 0;  /* more binades than a register's 32 lanes */
    for (int32_t f = 0; f < 32; f++) t->split[f] = INFINITY;
    t->seg[t->e_low % 32] = 0;  /* segment 0: k = o = 0 */
    int32_t s = 1, j = 0;
    for (int32_t f = t->e_low + 1; f <= 126; f++) {
        const float lo = ldexpf(1.0f, f - 127), hi = 2 * lo;
        while (j < n_pos && pos[j] < lo) j++;
        int32_t j1 = j;
        while (j1 < n_pos && pos[j1] < hi) j1++;
        j1--;  /* the binade's points: [j, j1] */
        int32_t cut = -1;  /* the first spacing at least 1.5 times the one before, or the middle of two points */
        if (j1 - j == 1) cut = j;
        for (int32_t i = j + 1; cut < 0 && i < j1; i++)
            if ((double)pos[i + 1] - pos[i] >= 1.5 * ((double)pos[i] - pos[i - 1])) cut = i;
        if (s + (cut >= 0) >= 32) return 0;
        t->seg[f % 32] = s;
        nearest8_line(t, s++, pos, j, cut >= 0 ? cut : j1, j);
        if (cut >= 0) {
            t->split[f % 32] = pos[cut] + (pos[cut + 1] - pos[cut]) / 2;
            nearest8_line(t, s++, pos, cut + 1, j1, cut + 1);
        }
    }
    map256_bytes(t->side_planes, t->side);
    return nearest8_proves(t, pos, n_pos, t->mirrored ? 128 : 255) &&
           (!t->mirrored || nearest8_proves(t, neg, n_neg, 128));
}

/* A map's fit, once per process: a few entries (the maps of the 8-bit codecs) behind a lock, as kernels on several
 * threads may meet a map first at once. NULL where the fit failed. */
static const nearest8_t *nearest8_of(const count_table_t *table) {
    static struct {
        float points[255];
        nearest8_t fit;
        int ok;
    } cache[4];
    static int used = 0;
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    if (table->n_points != 255) return NULL;
    const nearest8_t *found = NULL;
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < used && memcmp(cache[i].points, table->points, sizeof cache[i].points) != 0) i++;
    if (i == used && used < 4) {
        memcpy(cache[i].points, table->points, sizeof cache[i].points);
        cache[i].ok = nearest8_fit(&cache[i].fit, table->points, 255);
        used++;
    }
    if (i < used && cache[i].ok) found = &cache[i].fit;
    pthread_mutex_unlock(&lock);
    return found;
}

/* 0: the search where gathers are slow (AMD), the gather elsewhere; 1: the search; 2: the gather. Results are the
 * same bits either way (tests/test_native_nearest8.py sets it to hold the two alike). */
int slimopt_nearest8_mode = 0;

/* The fit an encode of n codes on this table's map takes: NULL where the gather is wanted (the mode above), n is not
 * a multiple of 64, or the map's fit failed */
static const nearest8_t *nearest8_for(const count_table_t *table, int64_t n) {
    static int amd = -1;
    if (amd < 0) amd = __builtin_cpu_is("amd");
    const int wanted = slimopt_nearest8_mode != 0 ? slimopt_nearest8_mode == 1 : amd;
    return wanted && n % 64 == 0 ? nearest8_of(table) : NULL;
}

/* A fit's tables in registers, with the map256_t of its side points */
typedef struct {
    __m512 split[2], k[2], o[2];
    __m512i seg[2];
    map256_t side;
    int32_t n_neg, mirrored, e_low;
} nearest8_regs_t;

static void nearest8_load(nearest8_regs_t *r, const nearest8_t *t) {
    for (int h = 0; h < 2; h++) {
        r->split[h] = _mm512_loadu_ps(t->split + 16 * h);
        r->k[h] = _mm512_loadu_ps(t->k + 16 * h);
        r->o[h] = _mm512_loadu_ps(t->o + 16 * h);
        r->seg[h] = _mm512_loadu_si512(t->seg + 16 * h);
    }
    map256_load(&r->side, (const uint8_t(*)[4][64])t->side_planes);
    r->n_neg = t->n_neg;
    r->mirrored = t->mirrored;
    r->e_low = t->e_low;
}

/* Byte 0 of each 32-bit lane of four registers, 64 bytes in element order or (lookup) in MAP256_ORDER's, as
 * map256_values64_ordered reads them: two byte permutes of two registers each, then one of the pair */
static inline __attribute__((always_inline)) __m512i low_bytes64(const __m512i r[4], const int lookup) {
    /* pair: the 32 low bytes of two registers; last: element e (< 32 of the first pair, else of the second) */
    static const uint8_t pair[64] = {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
        64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, 108, 112, 116, 120, 124,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    static const uint8_t last[2][64] = {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
        16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
        64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79,
        80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95},
        {0, 1, 2, 3, 16, 17, 18, 19, 64, 65, 66, 67, 80, 81, 82, 83,
        4, 5, 6, 7, 20, 21, 22, 23, 68, 69, 70, 71, 84, 85, 86, 87,
        8, 9, 10, 11, 24, 25, 26, 27, 72, 73, 74, 75, 88, 89, 90, 91,
        12, 13, 14, 15, 28, 29, 30, 31, 76, 77, 78, 79, 92, 93, 94, 95}};
    const __m512i p = _mm512_loadu_si512(pair);
    const __m512i lo = _mm512_permutex2var_epi8(r[0], p, r[1]), hi = _mm512_permutex2var_epi8(r[2], p, r[3]);
    return _mm512_permutex2var_epi8(lo, _mm512_loadu_si512(last[lookup]), hi);
}

/* |x| (NaN, inf and |x| >= 1 as the largest float below 1) and x's sign of 16 values */
static inline __attribute__((always_inline)) __m512 nearest8_magnitude(const float *x, __mmask16 *neg) {
    const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(x));
    *neg = _mm512_movepi32_mask(bits);
    return _mm512_castsi512_ps(_mm512_min_epu32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x3F7FFFFF)));
}

/* The first half for 64 values: c0 (the line's estimate) into c0s, and the points it looks up (negative x: the
 * mirrored ones, side[128 + c0]) as bytes in the look-up's order into index */
static inline __attribute__((always_inline)) void nearest8_estimate64(const nearest8_regs_t *r, const float *x,
                                                                      int32_t *c0s, uint8_t *index) {
    const __m512i e_low = _mm512_set1_epi32(r->e_low), one = _mm512_set1_epi32(1), side = _mm512_set1_epi32(128);
    __m512i looked[4];
    for (int q = 0; q < 4; q++) {
        __mmask16 neg;
        const __m512 a = nearest8_magnitude(x + 16 * q, &neg);
        const __m512i f = _mm512_max_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 23), e_low);
        const __mmask16 upper = _mm512_cmp_ps_mask(a, _mm512_permutex2var_ps(r->split[0], f, r->split[1]), _CMP_GE_OQ);
        __m512i seg = _mm512_permutex2var_epi32(r->seg[0], f, r->seg[1]);
        seg = _mm512_mask_add_epi32(seg, upper, seg, one);
        const __m512 g = _mm512_fmadd_ps(a, _mm512_permutex2var_ps(r->k[0], seg, r->k[1]),
                                         _mm512_permutex2var_ps(r->o[0], seg, r->o[1]));
        const __m512i c0 = _mm512_cvttps_epi32(g);
        _mm512_storeu_si512(c0s + 16 * q, c0);
        looked[q] = r->mirrored ? _mm512_mask_or_epi32(c0, neg, c0, side) : c0;
    }
    _mm512_storeu_si512(index, low_bytes64(looked, 1));
}

/* The second half: codes[i] = c0 + (|x| >= the point looked up), as a count of the signed points */
static inline __attribute__((always_inline)) void nearest8_finish64(const nearest8_regs_t *r, const float *x,
                                                                    const int32_t *c0s, const uint8_t *index,
                                                                    uint8_t *codes) {
    __m512 point[4];
    map256_values64_ordered(&r->side, _mm512_loadu_si512(index), point);
    const __m512i n_neg = _mm512_set1_epi32(r->n_neg), one = _mm512_set1_epi32(1);
    __m512i code[4];
    for (int q = 0; q < 4; q++) {
        __mmask16 neg;
        const __m512 a = nearest8_magnitude(x + 16 * q, &neg);
        const __m512i c0 = _mm512_loadu_si512(c0s + 16 * q);
        const __m512i count = _mm512_mask_add_epi32(c0, _mm512_cmp_ps_mask(a, point[q], _CMP_GE_OQ), c0, one);
        code[q] = r->mirrored ? _mm512_mask_sub_epi32(_mm512_add_epi32(n_neg, count), neg, n_neg, count)
                              : _mm512_maskz_mov_epi32(_knot_mask16(neg), count);
    }
    _mm512_storeu_si512(codes, low_bytes64(code, 0));
}

/* codes[i] = count(points <= x[i]) by a map's fit for n values (a multiple of 64), the table's count bit for bit:
 * in two passes over 512 values at a time (the estimates, then the look-ups), each with short chains that the
 * processor overlaps from one 64 to the next (measured faster than one pass) */
static void nearest8_codes(const nearest8_t *fit, const float *x, int64_t n, uint8_t *codes) {
    nearest8_regs_t regs;
    nearest8_load(&regs, fit);
    int32_t c0s[512];
    uint8_t index[512];
    for (int64_t i0 = 0; i0 < n; i0 += 512) {
        const int64_t m = n - i0 < 512 ? n - i0 : 512;
        for (int64_t i = 0; i < m; i += 64) nearest8_estimate64(&regs, x + i0 + i, c0s + i, index + i);
        for (int64_t i = 0; i < m; i += 64) nearest8_finish64(&regs, x + i0 + i, c0s + i, index + i, codes + i0 + i);
    }
}

/* The search on the 255 points of a map, whatever the processor: tests/test_native_nearest8.py checks it against
 * the table. Returns -1 where it does not apply (n not a multiple of 64, or a map the proof rejects). */
int slimopt_nearest8_codes(const float *points, const float *x, int64_t n, uint8_t *codes) {
    const count_table_t table = {NULL, points, 0, NULL, 255};
    const nearest8_t *fit = n % 64 == 0 ? nearest8_of(&table) : NULL;
    if (fit == NULL) return -1;
    nearest8_codes(fit, x, n, codes);
    return 0;
}

#endif /* __AVX512VBMI__ */
