// GGML block formats on the GPU (layouts as in ggml-quants.c and the CPU backend's quant.rs):
// element c of a row, a fused dequantize-matvec for decode (up to MATVEC_ROWS activation rows) and
// dequantize-to-f32/f16 for the prefill GEMMs.

__device__ __forceinline__ void scale_min_k4(int j, const u8* s, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Element c of a row stored as dtype T.
template <int T>
__device__ __forceinline__ float deq(const u8* row, int c) {
    if (T == DT_F32) return ((const float*)row)[c];
    if (T == DT_F16) return h2f(((const u16*)row)[c]);
    if (T == DT_BF16) return __uint_as_float(((unsigned)((const u16*)row)[c]) << 16);
    if (T == DT_Q8_0) {
        const u8* b = row + (c >> 5) * 34;
        return ld_h(b) * (float)(signed char)b[2 + (c & 31)];
    }
    if (T == DT_Q4_0 || T == DT_Q4_1) {
        int i = c & 31;
        const u8* b = row + (c >> 5) * (T == DT_Q4_1 ? 20 : 18);
        const u8* qs = b + (T == DT_Q4_1 ? 4 : 2);
        int q = i < 16 ? (qs[i] & 0xF) : (qs[i - 16] >> 4);
        float d = ld_h(b);
        if (T == DT_Q4_1) return d * (float)q + ld_h(b + 2);
        return d * (float)(q - 8);
    }
    if (T == DT_Q4_K) {
        const u8* b = row + (c >> 8) * 144;
        int i = c & 255, j = i >> 6, l = i & 63;
        int hi = l >= 32;
        int q = (b[16 + 32 * j + (l & 31)] >> (hi ? 4 : 0)) & 0xF;
        float sc, mn;
        scale_min_k4(2 * j + hi, b + 4, &sc, &mn);
        return ld_h(b) * sc * (float)q - ld_h(b + 2) * mn;
    }
    // DT_Q6_K
    const u8* b = row + (c >> 8) * 210;
    int i = c & 255, n = i >> 7, r = i & 127, quarter = r >> 5, l = r & 31;
    const u8* ql = b + 64 * n;
    const u8* qh = b + 128 + 32 * n;
    const signed char* sc = (const signed char*)(b + 192 + 8 * n);
    int low = (quarter & 1) ? ql[l + 32] : ql[l];
    low = (quarter & 2) ? (low >> 4) : (low & 0xF);
    int q = (low | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32;
    return ld_h(b + 208) * (float)sc[l / 16 + 2 * quarter] * (float)q;
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
    default: return deq<DT_Q6_K>(row, c);
    }
}

#define MATVEC_ROWS 8

// y[m, n] = x[m, k] · w[n, k]ᵀ for m <= MATVEC_ROWS: one warp per output column, each weight element
// dequantized once and used for every activation row.
template <int T>
__device__ void matvec_impl(const u8* w, long long row_bytes, const float* x, float* y, int m, int n, int k) {
    int col = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (col >= n) return;
    const u8* row = w + (long long)col * row_bytes;
    float acc[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) acc[r] = 0.0f;
    for (int c = lane; c < k; c += 32) {
        float wv = deq<T>(row, c);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++)
            if (r < m) acc[r] += wv * x[(long long)r * k + c];
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0 && r < m) y[(long long)r * n + col] = v;
    }
}

// out[r, c] = w[r, c] as f32 for rows*k elements (rows starting at w).
template <int T>
__device__ void dequant_f32_impl(const u8* w, long long row_bytes, float* out, long long rows, int k) {
    long long total = rows * k;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / k;
        out[i] = deq<T>(w + r * row_bytes, (int)(i - r * k));
    }
}

template <int T>
__device__ void dequant_f16_impl(const u8* w, long long row_bytes, u16* out, long long rows, int k) {
    long long total = rows * k;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / k;
        out[i] = f2h(deq<T>(w + r * row_bytes, (int)(i - r * k)));
    }
}

#define QUANT_KERNELS(NAME, T)                                                                                   \
    extern "C" __global__ void matvec_##NAME(const u8* w, long long rb, const float* x, float* y, int m, int n, int k) { \
        matvec_impl<T>(w, rb, x, y, m, n, k);                                                                    \
    }                                                                                                            \
    extern "C" __global__ void dequant_f32_##NAME(const u8* w, long long rb, float* out, long long rows, int k) {  \
        dequant_f32_impl<T>(w, rb, out, rows, k);                                                                \
    }                                                                                                            \
    extern "C" __global__ void dequant_f16_##NAME(const u8* w, long long rb, u16* out, long long rows, int k) {    \
        dequant_f16_impl<T>(w, rb, out, rows, k);                                                                \
    }

QUANT_KERNELS(f32, DT_F32)
QUANT_KERNELS(f16, DT_F16)
QUANT_KERNELS(bf16, DT_BF16)
QUANT_KERNELS(q8_0, DT_Q8_0)
QUANT_KERNELS(q4_0, DT_Q4_0)
QUANT_KERNELS(q4_1, DT_Q4_1)
QUANT_KERNELS(q4_k, DT_Q4_K)
QUANT_KERNELS(q6_k, DT_Q6_K)
