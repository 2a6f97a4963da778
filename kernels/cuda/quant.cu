// GGML block formats on the GPU (layouts as in ggml-quants.c and the CPU backend's quant.rs): runs
// of 8 elements of a row (and single elements), a fused dequantize-matvec for decode (up to
// MATVEC_ROWS activation rows) and dequantize-to-f32/f16 for the prefill GEMMs.

__constant__ signed char MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
__constant__ signed char IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

__device__ __forceinline__ void scale_min_k4(int j, const u8* s, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// The f32 at p, read byte by byte (the pre-quantized formats' blocks are not 4-byte aligned).
__device__ __forceinline__ float ld_f(const u8* p) {
    return __uint_as_float((unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24));
}

// An FP8 e4m3 byte as f32, exactly (as the CPU's quant_checkpoint::e4m3): bias 7, subnormals
// m·2^-9, 0x7F/0xFF NaN.
__device__ __forceinline__ float e4m3(u8 b) {
    const unsigned e = (b >> 3) & 0xF, m = b & 7, sign = ((unsigned)b & 0x80u) << 24;
    float mag;
    if (e == 0) {
        mag = (float)m * (1.0f / 512.0f);
    } else if (e == 15 && m == 7) {
        mag = __uint_as_float(0x7fc00000u);
    } else {
        mag = __uint_as_float(((e + 120) << 23) | (m << 20));
    }
    return __uint_as_float(__float_as_uint(mag) | sign);
}

// Elements c0 .. c0+7 of a row stored as block format T (c0 a multiple of 8): the run shares one
// block and one sub-block scale, so scales are decoded once per 8 elements.
template <int T>
__device__ __forceinline__ void deq8(const u8* row, int c0, float* v) {
    if (T == DT_Q8_0) {
        const u8* b = row + (c0 >> 5) * 34;
        const float d = ld_h(b);
        const u8* q = b + 2 + (c0 & 31);
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = d * (float)(signed char)q[e];
    } else if (T == DT_Q4_0 || T == DT_Q4_1) {
        const int i0 = c0 & 31;
        const u8* b = row + (c0 >> 5) * (T == DT_Q4_1 ? 20 : 18);
        const u8* qs = b + (T == DT_Q4_1 ? 4 : 2) + (i0 & 15);
        const int shift = i0 < 16 ? 0 : 4;
        const float d = ld_h(b);
        if (T == DT_Q4_1) {
            const float m = ld_h(b + 2);
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = d * (float)((qs[e] >> shift) & 0xF) + m;
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = d * (float)(((qs[e] >> shift) & 0xF) - 8);
        }
    } else if (T == DT_Q4_K || T == DT_Q5_K) {
        // d, dmin, 12 bytes of scales/mins, [Q5_K: 32 bytes of fifth bits,] 128 bytes of nibbles:
        // element i of 256 is nibble (i%64 < 32 ? low : high) of byte 32·(i/64) + i%32, its fifth
        // bit bit i/32 of byte i%32.
        const u8* b = row + (c0 >> 8) * (T == DT_Q5_K ? 176 : 144);
        const int i0 = c0 & 255, j = i0 >> 6, l0 = i0 & 63, hi = l0 >= 32;
        float sc, mn;
        scale_min_k4(2 * j + hi, b + 4, &sc, &mn);
        const float d = ld_h(b) * sc, m = ld_h(b + 2) * mn;
        const u8* q = b + (T == DT_Q5_K ? 48 : 16) + 32 * j + (l0 & 31);
        const u8* qh = b + 16 + (l0 & 31);
        const int shift = hi ? 4 : 0, bit = i0 >> 5;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int fifth = T == DT_Q5_K ? ((qh[e] >> bit) & 1) << 4 : 0;
            v[e] = d * (float)(((q[e] >> shift) & 0xF) | fifth) - m;
        }
    } else if (T == DT_Q5_0 || T == DT_Q5_1) {
        // d, [m,] 4 bytes of fifth bits, 16 bytes of nibbles: element i of 32 takes nibble i & 15
        // (low for i < 16) and fifth bit i.
        const int i0 = c0 & 31;
        const u8* b = row + (c0 >> 5) * (T == DT_Q5_1 ? 24 : 22);
        const u8* hb = b + (T == DT_Q5_1 ? 4 : 2);
        const unsigned qh = (unsigned)hb[0] | ((unsigned)hb[1] << 8) | ((unsigned)hb[2] << 16) | ((unsigned)hb[3] << 24);
        const u8* qs = hb + 4 + (i0 & 15);
        const int shift = i0 < 16 ? 0 : 4;
        const float d = ld_h(b);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int q = ((qs[e] >> shift) & 0xF) | (((qh >> (i0 + e)) & 1) << 4);
            v[e] = T == DT_Q5_1 ? d * (float)q + ld_h(b + 2) : d * (float)(q - 16);
        }
    } else if (T == DT_Q2_K) {
        // 16 scale bytes, 64 bytes of 2-bit values, d, dmin: element i of 256 is in half i/128,
        // shift 2·((i%128)/32), byte (i%32) of the half, scale byte i/16.
        const u8* b = row + (c0 >> 8) * 84;
        const int i0 = c0 & 255, half = i0 >> 7, r = i0 & 127, shift = 2 * (r >> 5), l0 = r & 31;
        const u8 sc = b[i0 >> 4];
        const float dl = ld_h(b + 80) * (float)(sc & 0xF), ml = ld_h(b + 82) * (float)(sc >> 4);
        const u8* q = b + 16 + 32 * half + l0;
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = dl * (float)((q[e] >> shift) & 3) - ml;
    } else if (T == DT_Q3_K) {
        // 32 bytes of high bits, 64 of 2-bit values, 12 of packed 6-bit scales, d: as Q2_K, minus 4
        // where the high bit (bit i/32 of byte i%32) is clear.
        const u8* b = row + (c0 >> 8) * 110;
        const int i0 = c0 & 255, half = i0 >> 7, r = i0 & 127, shift = 2 * (r >> 5), l0 = r & 31;
        const int is = i0 >> 4;
        const u8* p = b + 96;
        const int low = is < 8 ? (p[is] & 0xF) : (p[is - 8] >> 4);
        const int high = (p[8 + (is & 3)] >> (2 * (is >> 2))) & 3;
        const float dl = ld_h(b + 108) * (float)((low | (high << 4)) - 32);
        const u8* q = b + 32 + 32 * half + l0;
        const u8* hm = b + l0;
        const int bit = i0 >> 5;
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = dl * (float)((int)((q[e] >> shift) & 3) - (((hm[e] >> bit) & 1) ? 0 : 4));
    } else if (T == DT_FP8_E4M3_B128 || T == DT_INT8_B128) {
        // f32 scale, 128 bytes (e4m3 or int8).
        const u8* b = row + (c0 >> 7) * 132;
        const float s = ld_f(b);
        const u8* q = b + 4 + (c0 & 127);
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = (T == DT_FP8_E4M3_B128 ? e4m3(q[e]) : (float)(signed char)q[e]) * s;
    } else if (T == DT_INT4_G128) {
        // f32 scale, u8 zero, 64 bytes: value j < 64 the low nibble of byte j, j >= 64 the high
        // nibble of byte j - 64.
        const int i0 = c0 & 127;
        const u8* b = row + (c0 >> 7) * 69;
        const float s = ld_f(b);
        const int z = b[4], shift = i0 < 64 ? 0 : 4;
        const u8* q = b + 5 + (i0 & 63);
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = (float)(((q[e] >> shift) & 0xF) - z) * s;
    } else if (T == DT_MXFP4) {
        // e8m0 scale byte, 16 bytes of nibbles (value i < 16 low nibble of byte i, else high nibble
        // of byte i − 16); value = 2^(e − 128) · the doubled e2m1 value (ggml_e8m0_to_fp32_half).
        const int i0 = c0 & 31;
        const u8* b = row + (c0 >> 5) * 17;
        const unsigned e = b[0];
        const float d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
        const u8* q = b + 1 + (i0 & 15);
        const int shift = i0 < 16 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = d * (float)MXFP4_VALUES[(q[k] >> shift) & 0xF];
    } else if (T == DT_TQ2_0) {
        // 64 bytes of 2-bit codes, f16 d: value 128·h + 32·l + m is bits 2l of byte 32·h + m.
        const u8* b = row + (c0 >> 8) * 66;
        const int i0 = c0 & 255, h = i0 >> 7, l = (i0 >> 5) & 3, m0 = i0 & 31;
        const float d = ld_h(b + 64);
        const u8* q = b + 32 * h + m0;
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = (float)(((q[e] >> (2 * l)) & 3) - 1) * d;
    } else if (T == DT_TQ1_0) {
        // 48 bytes of five base-3 digits (values 0..160: digit i/32 of byte i%32; 160..240: digit
        // (i-160)/16 of byte 32 + (i-160)%16), 4 bytes of four digits (240..256: digit (i-240)/4 of
        // byte 48 + (i-240)%4), f16 d; digit n of q is ((q·3^n mod 256)·3) >> 8.
        const u8* b = row + (c0 >> 8) * 54;
        const int i0 = c0 & 255;
        const float d = ld_h(b + 52);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int i = i0 + e;
            int byte, n;
            if (i < 160) {
                byte = i & 31, n = i >> 5;
            } else if (i < 240) {
                byte = 32 + ((i - 160) & 15), n = (i - 160) >> 4;
            } else {
                byte = 48 + ((i - 240) & 3), n = (i - 240) >> 2;
            }
            const unsigned p3 = n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
            const unsigned q = (b[byte] * p3) & 0xFFu;
            v[e] = (float)((int)((q * 3u) >> 8) - 1) * d;
        }
    } else if (T == DT_IQ4_NL || T == DT_IQ4_XS) {
        // Level indices into the non-linear table; IQ4_NL: d per 32, IQ4_XS: d·(scale − 32) per 32
        // of 256 (low nibbles of bytes 4..8, high bits in the u16 at 2).
        const int i0 = T == DT_IQ4_NL ? (c0 & 31) : (c0 & 255);
        const u8* b = row + (T == DT_IQ4_NL ? (c0 >> 5) * 18 : (c0 >> 8) * 136);
        float dl = ld_h(b);
        const u8* qs;
        if (T == DT_IQ4_XS) {
            const int ib = i0 >> 5;
            const int sh = (int)b[2] | ((int)b[3] << 8);
            const int ls = ((b[4 + ib / 2] >> (4 * (ib & 1))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
            dl *= (float)(ls - 32);
            qs = b + 8 + 16 * ib + (i0 & 15);
        } else {
            qs = b + 2 + (i0 & 15);
        }
        const int shift = (i0 & 31) < 16 ? 0 : 4;
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = dl * (float)IQ4_LEVELS[(qs[e] >> shift) & 0xF];
    } else {  // DT_Q6_K
        const u8* b = row + (c0 >> 8) * 210;
        const int i0 = c0 & 255, n = i0 >> 7, r = i0 & 127, quarter = r >> 5, l0 = r & 31;
        const u8* ql = b + 64 * n + ((quarter & 1) ? 32 : 0) + l0;
        const u8* qh = b + 128 + 32 * n + l0;
        const int lshift = (quarter & 2) ? 4 : 0, hshift = 2 * quarter;
        const float d = ld_h(b + 208) * (float)((const signed char*)(b + 192 + 8 * n))[l0 / 16 + 2 * quarter];
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = d * (float)((((ql[e] >> lshift) & 0xF) | (((qh[e] >> hshift) & 3) << 4)) - 32);
    }
}

// Element c of a row stored as dtype T.
template <int T>
__device__ __forceinline__ float deq(const u8* row, int c) {
    if (T == DT_F32) return ((const float*)row)[c];
    if (T == DT_F16) return h2f(((const u16*)row)[c]);
    if (T == DT_BF16) return __uint_as_float(((unsigned)((const u16*)row)[c]) << 16);
    float v[8];
    deq8<T>(row, c & ~7, v);
    return v[c & 7];
}

// Eight elements for any dtype (float formats element by element).
template <int T>
__device__ __forceinline__ void deq8_any(const u8* row, int c0, float* v) {
    if (T == DT_F32 || T == DT_F16 || T == DT_BF16) {
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = deq<T>(row, c0 + e);
    } else {
        deq8<T>(row, c0, v);
    }
}

// The same, with the dtype chosen at run time (norm weights, biases, embedding rows).
__device__ float deq_rt(const u8* row, int t, int c) {
    switch (t) {
    case DT_F32: return deq<DT_F32>(row, c);
    case DT_F16: return deq<DT_F16>(row, c);
    case DT_BF16: return deq<DT_BF16>(row, c);
    case DT_Q8_0: return deq<DT_Q8_0>(row, c);
    case DT_Q4_0: return deq<DT_Q4_0>(row, c);
    case DT_Q4_1: return deq<DT_Q4_1>(row, c);
    case DT_Q4_K: return deq<DT_Q4_K>(row, c);
    case DT_Q5_0: return deq<DT_Q5_0>(row, c);
    case DT_Q5_1: return deq<DT_Q5_1>(row, c);
    case DT_Q2_K: return deq<DT_Q2_K>(row, c);
    case DT_Q3_K: return deq<DT_Q3_K>(row, c);
    case DT_Q5_K: return deq<DT_Q5_K>(row, c);
    case DT_IQ4_NL: return deq<DT_IQ4_NL>(row, c);
    case DT_IQ4_XS: return deq<DT_IQ4_XS>(row, c);
    case DT_TQ1_0: return deq<DT_TQ1_0>(row, c);
    case DT_TQ2_0: return deq<DT_TQ2_0>(row, c);
    case DT_FP8_E4M3_B128: return deq<DT_FP8_E4M3_B128>(row, c);
    case DT_INT8_B128: return deq<DT_INT8_B128>(row, c);
    case DT_INT4_G128: return deq<DT_INT4_G128>(row, c);
    case DT_MXFP4: return deq<DT_MXFP4>(row, c);
    default: return deq<DT_Q6_K>(row, c);
    }
}

// ---- 32-weight units read with wide loads, for the decode matvec.
// A unit is 32 weights of a row that one lane decodes from one stretch of bytes: two runs of 16
// columns, [ca, ca+16) and [cb, cb+16). Formats whose blocks are 16-byte multiples (Q4_K, Q5_K and
// the float formats) load 16 bytes at a time; Q4_1/Q5_1 rows are 4-byte aligned, Q4_0/Q5_0/Q8_0/Q6_K
// 2-byte aligned (their blocks are 18, 22, 34, 210 bytes), so those load words or halves. The
// backend picks matvec32_* when the row width is a multiple of 32 and the rows meet the format's
// alignment (matvec32_align in source.rs), matvec_* otherwise.

struct alignas(16) V16 {
    unsigned a, b, c, d;
};

// 16 bytes at p as four little-endian words; `align` is what p is known to be aligned to.
template <int align>
__device__ __forceinline__ void ld16(const u8* p, unsigned* o) {
    if (align == 16) {
        const V16 v = *(const V16*)p;
        o[0] = v.a, o[1] = v.b, o[2] = v.c, o[3] = v.d;
    } else if (align == 4) {
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = ((const unsigned*)p)[i];
    } else {
        const u16* h = (const u16*)p;
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = (unsigned)h[2 * i] | ((unsigned)h[2 * i + 1] << 16);
    }
}

// Byte e (0..15) of four loaded words.
__device__ __forceinline__ int byte_of(const unsigned* o, int e) {
    return (int)((o[e >> 2] >> (8 * (e & 3))) & 0xFFu);
}

// Sub-block j's scale and min of a Q4_K/Q5_K super-block whose first 16 bytes (d, dmin, 12 bytes of
// packed scales) were loaded as `head`.
__device__ __forceinline__ void k4_scale_min(const unsigned* head, int j, float* sc, float* mn) {
    u8 s[12];
#pragma unroll
    for (int e = 0; e < 12; e++) s[e] = (u8)byte_of(head + 1, e);
    scale_min_k4(j, s, sc, mn);
}

// Unit u of a row of type T: wv[0..16] are columns ca.., wv[16..32] columns cb...
template <int T>
__device__ __forceinline__ void unit32(const u8* row, int u, float* wv, int* ca, int* cb) {
    if (T == DT_Q4_0 || T == DT_Q4_1 || T == DT_Q5_0 || T == DT_Q5_1 || T == DT_Q8_0) {
        *ca = 32 * u, *cb = 32 * u + 16;
        if (T == DT_Q8_0) {
            const u8* b = row + 34 * u;
            const float d = ld_h(b);
            unsigned lo[4], hi[4];
            ld16<2>(b + 2, lo);
            ld16<2>(b + 18, hi);
#pragma unroll
            for (int e = 0; e < 16; e++) {
                wv[e] = d * (float)(signed char)byte_of(lo, e);
                wv[16 + e] = d * (float)(signed char)byte_of(hi, e);
            }
            return;
        }
        const int bytes = T == DT_Q4_0 ? 18 : T == DT_Q4_1 ? 20 : T == DT_Q5_0 ? 22 : 24;
        const bool has_min = T == DT_Q4_1 || T == DT_Q5_1, five = T == DT_Q5_0 || T == DT_Q5_1;
        const u8* b = row + bytes * u;
        const float d = ld_h(b), m = has_min ? ld_h(b + 2) : 0.0f;
        const u8* hb = b + (has_min ? 4 : 2);
        unsigned qh = 0;
        if (five) qh = (unsigned)((const u16*)hb)[0] | ((unsigned)((const u16*)hb)[1] << 16);
        unsigned q[4];
        if (has_min) {
            ld16<4>(hb + (five ? 4 : 0), q);
        } else {
            ld16<2>(hb + (five ? 4 : 0), q);
        }
        const int off = five ? 16 : 8;
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const int x = byte_of(q, e);
            const int lo = (x & 0xF) | (five ? (int)((qh >> e) & 1) << 4 : 0);
            const int hi = (x >> 4) | (five ? (int)((qh >> (16 + e)) & 1) << 4 : 0);
            wv[e] = has_min ? d * (float)lo + m : d * (float)(lo - off);
            wv[16 + e] = has_min ? d * (float)hi + m : d * (float)(hi - off);
        }
    } else if (T == DT_Q4_K || T == DT_Q5_K) {
        // Unit i of super-block s: bytes 16·(i&1).. of the 32 holding sub-blocks 2j (low nibbles)
        // and 2j+1 (high), j = i/2; Q5_K's fifth bits are bits 2j and 2j+1 of the same qh bytes.
        const int s = u >> 3, i = u & 7, j = i >> 1, h = i & 1;
        const u8* b = row + s * (T == DT_Q5_K ? 176 : 144);
        unsigned head[4], q[4], qh[4];
        ld16<16>(b, head);
        ld16<16>(b + (T == DT_Q5_K ? 48 : 16) + 32 * j + 16 * h, q);
        if (T == DT_Q5_K) ld16<16>(b + 16 + 16 * h, qh);
        float s_lo, m_lo, s_hi, m_hi;
        k4_scale_min(head, 2 * j, &s_lo, &m_lo);
        k4_scale_min(head, 2 * j + 1, &s_hi, &m_hi);
        const float d = h2f((u16)(head[0] & 0xFFFF)), dmin = h2f((u16)(head[0] >> 16));
        const float d_lo = d * s_lo, d_hi = d * s_hi, min_lo = dmin * m_lo, min_hi = dmin * m_hi;
        *ca = 256 * s + 64 * j + 16 * h, *cb = *ca + 32;
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const int x = byte_of(q, e);
            const int f = T == DT_Q5_K ? byte_of(qh, e) : 0;
            const int lo = (x & 0xF) | (T == DT_Q5_K ? ((f >> (2 * j)) & 1) << 4 : 0);
            const int hi = (x >> 4) | (T == DT_Q5_K ? ((f >> (2 * j + 1)) & 1) << 4 : 0);
            wv[e] = d_lo * (float)lo - min_lo;
            wv[16 + e] = d_hi * (float)hi - min_hi;
        }
    } else if (T == DT_Q6_K) {
        // Unit i of super-block s: half n = i/4, ql bytes l0.. (l0 = 0 or 16) of the low 32
        // (quarters 0 and 2, i&2 clear) or the high 32 (quarters 1 and 3), with their qh bytes.
        const int s = u >> 3, i = u & 7, n = i >> 2, up = (i >> 1) & 1, l0 = 16 * (i & 1);
        const u8* b = row + 210 * s;
        unsigned ql[4], qh[4];
        ld16<2>(b + 64 * n + 32 * up + l0, ql);
        ld16<2>(b + 128 + 32 * n + l0, qh);
        const signed char* sc = (const signed char*)(b + 192 + 8 * n);
        const float d = ld_h(b + 208);
        const float d_lo = d * (float)sc[l0 / 16 + 2 * up], d_hi = d * (float)sc[l0 / 16 + 2 * (up + 2)];
        *ca = 256 * s + 128 * n + 32 * up + l0, *cb = *ca + 64;
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const int x = byte_of(ql, e), f = byte_of(qh, e);
            wv[e] = d_lo * (float)(((x & 0xF) | (((f >> (2 * up)) & 3) << 4)) - 32);
            wv[16 + e] = d_hi * (float)(((x >> 4) | (((f >> (2 * up + 4)) & 3) << 4)) - 32);
        }
    } else if (T == DT_F32 || T == DT_F16 || T == DT_BF16) {
        *ca = 32 * u, *cb = 32 * u + 16;
        const int esz = T == DT_F32 ? 4 : 2;
        const u8* p = row + (long long)32 * u * esz;
#pragma unroll
        for (int c = 0; c < 32 * esz / 16; c++) {
            unsigned o[4];
            ld16<16>(p + 16 * c, o);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (T == DT_F32) {
                    wv[4 * c + e] = __uint_as_float(o[e]);
                } else {
                    const u16 a = (u16)(o[e] & 0xFFFF), z = (u16)(o[e] >> 16);
                    wv[8 * c + 2 * e] = T == DT_F16 ? h2f(a) : __uint_as_float((unsigned)a << 16);
                    wv[8 * c + 2 * e + 1] = T == DT_F16 ? h2f(z) : __uint_as_float((unsigned)z << 16);
                }
            }
        }
    } else {
        // Q2_K, Q3_K, IQ4_NL, IQ4_XS and the pre-quantized formats: four runs of 8 through the
        // element decoder.
        *ca = 32 * u, *cb = 32 * u + 16;
#pragma unroll
        for (int r = 0; r < 4; r++) deq8<T>(row, 32 * u + 8 * r, wv + 8 * r);
    }
}

struct alignas(16) F4 {
    float a, b, c, d;
};

// Σ w[e]·x[e] over 16 values, x 16-byte aligned.
__device__ __forceinline__ float dot16(const float* w, const float* x) {
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const F4 v = ((const F4*)x)[c];
        s += w[4 * c] * v.a + w[4 * c + 1] * v.b + w[4 * c + 2] * v.c + w[4 * c + 3] * v.d;
    }
    return s;
}

#define MATVEC_ROWS 8

// y[m, n] = x[m, k] · w[n, k]ᵀ for m <= MATVEC_ROWS: one warp per output column, the weights read
// once per step for every activation row. WIDE (k a multiple of 32, x rows 16-byte aligned, the
// rows meeting unit32's alignment): each lane decodes whole 32-weight units with wide loads;
// otherwise runs of 8 elements (one scale decode per run) and single elements for a ragged tail.
template <int T, bool WIDE>
__device__ void matvec_impl(const u8* w, long long row_bytes, const float* x, float* y, int m, int n, int k) {
    int col = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (col >= n) return;
    const u8* row = w + (long long)col * row_bytes;
    float acc[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) acc[r] = 0.0f;
    if (WIDE) {
        for (int u = lane; u < (k >> 5); u += 32) {
            float wv[32];
            int ca, cb;
            unit32<T>(row, u, wv, &ca, &cb);
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++) {
                if (r < m) {
                    const float* xr = x + (long long)r * k;
                    acc[r] += dot16(wv, xr + ca) + dot16(wv + 16, xr + cb);
                }
            }
        }
    } else {
        const int k8 = k & ~7;
        for (int c0 = lane * 8; c0 < k8; c0 += 256) {
            float wv[8];
            deq8_any<T>(row, c0, wv);
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++) {
                if (r < m) {
                    const float* xr = x + (long long)r * k + c0;
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[r] += wv[e] * xr[e];
                }
            }
        }
        // Float weights whose width is not a multiple of 8 (block formats always are).
        for (int c = k8 + lane; c < k; c += 32) {
            float wv = deq<T>(row, c);
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++)
                if (r < m) acc[r] += wv * x[(long long)r * k + c];
        }
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0 && r < m) y[(long long)r * n + col] = v;
    }
}

// out[r, c] = w[r, c] converted by `conv`, for rows*k elements (rows starting at w); each thread
// takes runs of 8 elements of one row when k is a multiple of 8, single elements otherwise.
template <int T, class Out, class Conv>
__device__ void dequant_impl(const u8* w, long long row_bytes, Out* out, long long rows, int k, Conv conv) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if ((k & 7) == 0) {
        const long long runs = rows * (k >> 3);
        for (long long g = first; g < runs; g += stride) {
            const long long i = g << 3, r = i / k;
            float v[8];
            deq8_any<T>(w + r * row_bytes, (int)(i - r * k), v);
#pragma unroll
            for (int e = 0; e < 8; e++) out[i + e] = conv(v[e]);
        }
        return;
    }
    for (long long i = first; i < rows * k; i += stride) {
        long long r = i / k;
        out[i] = conv(deq<T>(w + r * row_bytes, (int)(i - r * k)));
    }
}

struct AsF32 {
    __device__ float operator()(float v) const { return v; }
};
struct AsF16 {
    __device__ u16 operator()(float v) const { return f2h(v); }
};
struct AsBf16 {
    __device__ u16 operator()(float v) const { return f2bf(v); }
};

#define QUANT_KERNELS(NAME, T)                                                                                   \
    extern "C" __global__ void matvec_##NAME(const u8* w, long long rb, const float* x, float* y, int m, int n, int k) { \
        matvec_impl<T, false>(w, rb, x, y, m, n, k);                                                                    \
    }                                                                                                            \
    extern "C" __global__ void matvec32_##NAME(const u8* w, long long rb, const float* x, float* y, int m, int n, int k) { \
        matvec_impl<T, true>(w, rb, x, y, m, n, k);                                                                   \
    }                                                                                                            \
    extern "C" __global__ void dequant_f32_##NAME(const u8* w, long long rb, float* out, long long rows, int k) {  \
        dequant_impl<T>(w, rb, out, rows, k, AsF32());                                                           \
    }                                                                                                            \
    extern "C" __global__ void dequant_f16_##NAME(const u8* w, long long rb, u16* out, long long rows, int k) {    \
        dequant_impl<T>(w, rb, out, rows, k, AsF16());                                                           \
    }                                                                                                            \
    extern "C" __global__ void dequant_bf16_##NAME(const u8* w, long long rb, u16* out, long long rows, int k) {   \
        dequant_impl<T>(w, rb, out, rows, k, AsBf16());                                                          \
    }

// Every stored dtype as X(kernel suffix, DT_* code) — the kernels below and the host emulator's
// dispatch (kernels/emu/quant_main.cpp) expand this one list.
#define EVERY_DTYPE(X)                                                                                 \
    X(f32, DT_F32) X(f16, DT_F16) X(bf16, DT_BF16) X(q8_0, DT_Q8_0) X(q4_0, DT_Q4_0) X(q4_1, DT_Q4_1)   \
    X(q4_k, DT_Q4_K) X(q6_k, DT_Q6_K) X(q5_0, DT_Q5_0) X(q5_1, DT_Q5_1) X(q2_k, DT_Q2_K)                \
    X(q3_k, DT_Q3_K) X(q5_k, DT_Q5_K) X(iq4_nl, DT_IQ4_NL) X(iq4_xs, DT_IQ4_XS) X(tq1_0, DT_TQ1_0)         \
    X(tq2_0, DT_TQ2_0) X(fp8_e4m3_b128, DT_FP8_E4M3_B128) X(int8_b128, DT_INT8_B128)                   \
    X(int4_g128, DT_INT4_G128) X(mxfp4, DT_MXFP4)

EVERY_DTYPE(QUANT_KERNELS)
