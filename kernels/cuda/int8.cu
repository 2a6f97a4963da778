// 8-bit activations for the decode matvec (`--int8-activations`, as the CPU's cpu/int8.rs and
// llama.cpp's mmvq): each activation row quantized once per matmul to blocks of 32 signed bytes
// with a scale d (x ≈ d·q) and d·Σq, then every 32-weight unit of Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
// dotted with its activation block four bytes per __dp4a — the f32 path's 8 FMAs per weight at 8
// rows become 2 integer instructions, what batch-8 decode needs to stay bound by memory.

// One warp per block of 32 values: d = max|x| / 127, q = round(x / d) (half away from zero),
// ds = d·Σq — quantize_row of cpu/int8.rs.
extern "C" __global__ void quantize_q8(const float* x, signed char* q, float* d, float* ds, long long blocks) {
    const long long b = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (b >= blocks) return;
    const float v = x[b * 32 + lane];
    const float amax = warp_reduce<MaxOp>(fabsf(v));
    const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
    const float qv = fminf(fmaxf(roundf(v * id), -127.0f), 127.0f);
    q[b * 32 + lane] = (signed char)qv;
    const float s = warp_sum(qv);
    if (lane == 0) d[b] = db, ds[b] = db * s;
}

// Unit u (columns 32u..32u+32, activation block u) of a row as eight words of bytes, value e in
// byte e, with what turns its integer sums into the dot: value = a0 (first 16) or a1 (last 16)
// times (byte − bias), plus `off` times the activation block's d·Σq.
template <int T>
__device__ __forceinline__ void unit_q8(const u8* row, int u, int* wq, float* a0, float* a1, int* bias, float* off) {
    unsigned o[8];
    *bias = 0, *off = 0.0f;
    if (T == DT_Q8_0) {
        const u8* b = row + 34 * u;
        ld16<2>(b + 2, o);
        ld16<2>(b + 18, o + 4);
        *a0 = *a1 = ld_h(b);
#pragma unroll
        for (int i = 0; i < 8; i++) wq[i] = (int)o[i];
    } else if (T == DT_Q4_0 || T == DT_Q4_1) {
        const u8* b = row + (T == DT_Q4_1 ? 20 : 18) * u;
        if (T == DT_Q4_1) {
            ld16<4>(b + 4, o);
        } else {
            ld16<2>(b + 2, o);
        }
        const float d = ld_h(b);
        *a0 = *a1 = d;
        *off = T == DT_Q4_1 ? ld_h(b + 2) : -8.0f * d;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            wq[i] = (int)(o[i] & 0x0F0F0F0Fu);
            wq[4 + i] = (int)((o[i] >> 4) & 0x0F0F0F0Fu);
        }
    } else if (T == DT_Q4_K) {
        // Sub-block j = u % 8 of super-block u / 8: nibbles (low for even j) of its 32 bytes.
        const int s = u >> 3, j = u & 7, shift = 4 * (j & 1);
        const u8* b = row + 144 * s;
        unsigned head[4];
        ld16<16>(b, head);
        ld16<16>(b + 16 + 32 * (j >> 1), o);
        ld16<16>(b + 32 + 32 * (j >> 1), o + 4);
        float scale, mn;
        k4_scale_min(head, j, &scale, &mn);
        *a0 = *a1 = h2f((u16)(head[0] & 0xFFFF)) * scale;
        *off = -h2f((u16)(head[0] >> 16)) * mn;
#pragma unroll
        for (int i = 0; i < 8; i++) wq[i] = (int)((o[i] >> shift) & 0x0F0F0F0Fu);
    } else {  // DT_Q6_K
        // Quarter c % 4 of half c / 4 (c = u % 8): 4 low bits from ql, 2 high from qh, less 32;
        // a signed scale per 16.
        const int s = u >> 3, c = u & 7, n = c >> 2, quarter = c & 3;
        const u8* b = row + 210 * s;
        unsigned h[8];
        ld16<2>(b + 64 * n + 32 * (quarter & 1), o);
        ld16<2>(b + 64 * n + 32 * (quarter & 1) + 16, o + 4);
        ld16<2>(b + 128 + 32 * n, h);
        ld16<2>(b + 128 + 32 * n + 16, h + 4);
        const int lshift = (quarter & 2) ? 4 : 0, hshift = 2 * quarter;
        const signed char* sc = (const signed char*)(b + 192 + 8 * n + 2 * quarter);
        const float d = ld_h(b + 208);
        *a0 = d * (float)sc[0], *a1 = d * (float)sc[1];
        *bias = 32;
#pragma unroll
        for (int i = 0; i < 8; i++) wq[i] = (int)(((o[i] >> lshift) & 0x0F0F0F0Fu) | (((h[i] >> hshift) & 0x03030303u) << 4));
    }
}

// y[m, n] = x[m, k] · w[n, k]ᵀ from 8-bit activations (quantize_q8; k a multiple of 32, of 256 for
// the K formats): one warp per output column, each lane whole units, the weights read once for all
// m <= MATVEC_ROWS rows.
template <int T>
__device__ void matvec_q8_impl(const u8* w, long long row_bytes, const signed char* q, const float* d, const float* ds,
                               float* y, int m, int n, int k) {
    const int col = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (col >= n) return;
    const u8* row = w + (long long)col * row_bytes;
    const int units = k >> 5;
    float acc[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) acc[r] = 0.0f;
    for (int u = lane; u < units; u += 32) {
        int wq[8], bias;
        float a0, a1, off;
        unit_q8<T>(row, u, wq, &a0, &a1, &bias, &off);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) {
            if (r < m) {
                unsigned xq[8];
                ld16<16>((const u8*)(q + (long long)r * k + 32 * u), xq);
                ld16<16>((const u8*)(q + (long long)r * k + 32 * u + 16), xq + 4);
                int i0 = 0, i1 = 0, s0 = 0, s1 = 0;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    i0 = __dp4a(wq[i], (int)xq[i], i0);
                    i1 = __dp4a(wq[4 + i], (int)xq[4 + i], i1);
                    if (T == DT_Q6_K) {
                        s0 = __dp4a(0x01010101, (int)xq[i], s0);
                        s1 = __dp4a(0x01010101, (int)xq[4 + i], s1);
                    }
                }
                i0 -= bias * s0, i1 -= bias * s1;
                const long long blk = (long long)r * units + u;
                acc[r] += d[blk] * (a0 * (float)i0 + a1 * (float)i1) + off * ds[blk];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        const float v = warp_sum(acc[r]);
        if (lane == 0 && r < m) y[(long long)r * n + col] = v;
    }
}

#define Q8_KERNEL(NAME, T)                                                                                     \
    extern "C" __global__ void matvec_q8_##NAME(const u8* w, long long rb, const signed char* q, const float* d, \
                                                const float* ds, float* y, int m, int n, int k) {              \
        matvec_q8_impl<T>(w, rb, q, d, ds, y, m, n, k);                                                        \
    }

// The dtypes with an 8-bit kernel, as X(suffix, DT_* code) (source.rs matvec_q8_supports says the same).
#define Q8_DTYPES(X) X(q8_0, DT_Q8_0) X(q4_0, DT_Q4_0) X(q4_1, DT_Q4_1) X(q4_k, DT_Q4_K) X(q6_k, DT_Q6_K)

Q8_DTYPES(Q8_KERNEL)
