/* A 256-value map as byte planes in registers (AVX-512 VBMI): the 8-bit codes' values without a gather, 64 at a
 * time. Used by the AdamW step's decode (adamw_avx512.h) and the 8-bit search's look-up (nearest8_avx512.h). */

#ifdef __AVX512VBMI__
/* A 256-value map as four byte planes in sixteen registers: byte j of map[64 q + i] is byte i of plane[j][q]. A code's
 * value is then two two-register byte permutes per plane, 64 codes at a time, in place of a gather (measured in
 * docs/benchmarks.md). */
typedef struct {
    __m512i plane[4][4];
} map256_t;

/* the planes' bytes of a map (once per map where it is fixed), and their registers */
static void map256_bytes(uint8_t bytes[4][4][64], const float *map) {
    for (int j = 0; j < 4; j++)
        for (int q = 0; q < 4; q++)
            for (int i = 0; i < 64; i++) {
                uint32_t u;
                memcpy(&u, &map[64 * q + i], 4);
                bytes[j][q][i] = (uint8_t)(u >> (8 * j));
            }
}

static void map256_load(map256_t *t, const uint8_t bytes[4][4][64]) {
    for (int j = 0; j < 4; j++)
        for (int q = 0; q < 4; q++) t->plane[j][q] = _mm512_loadu_si512(bytes[j][q]);
}

static void map256_init(map256_t *t, const float *map) {
    uint8_t bytes[4][4][64];
    map256_bytes(bytes, map);
    map256_load(t, (const uint8_t(*)[4][64])bytes);
}

/* the two unpack rounds below leave lane L of result r with elements 16 L + 4 r .. + 3: the codes are permuted first
 * so that result r holds elements 16 r .. 16 r + 15 in order */
static const uint8_t MAP256_ORDER[64] = {
     0,  1,  2,  3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
     4,  5,  6,  7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
     8,  9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

/* out[r] = map[codes[16 r .. 16 r + 15]] for 64 codes already in MAP256_ORDER's order */
static inline __attribute__((always_inline)) void map256_values64_ordered(const map256_t *t, __m512i c, __m512 out[4]) {
    const __mmask64 high = _mm512_movepi8_mask(c);  /* codes 128..255: planes 2 and 3 */
    __m512i b[4];
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t->plane[j][0], c, t->plane[j][1]),
                                      _mm512_permutex2var_epi8(t->plane[j][2], c, t->plane[j][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

/* out[r] = map[codes[16 r .. 16 r + 15]] for the 64 codes of one register */
static inline __attribute__((always_inline)) void map256_values64(const map256_t *t, __m512i codes, __m512 out[4]) {
    map256_values64_ordered(t, _mm512_permutexvar_epi8(_mm512_loadu_si512(MAP256_ORDER), codes), out);
}

/* out[i] = map[codes[i]] for i < n (n a multiple of 16): called 64 codes at a time from the AdamW loop */
static inline __attribute__((always_inline)) void map256_decode(const map256_t *t, const uint8_t *codes, int64_t n,
                                                                float *out) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 v[4];
        map256_values64(t, _mm512_loadu_si512(codes + i), v);
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(out + i + 16 * r, v[r]);
    }
    for (; i < n; i++) {  /* a run's last 16 to 48 codes */
        uint32_t u = 0;
        for (int j = 0; j < 4; j++) {
            uint8_t plane[64];
            _mm512_storeu_si512(plane, t->plane[j][codes[i] / 64]);
            u |= (uint32_t)plane[codes[i] % 64] << (8 * j);
        }
        memcpy(out + i, &u, 4);
    }
}
#endif
