// Runs the quantized matvec and dequantize kernels of kernels/cuda/quant.cu under the host emulator.
// Usage: quant-emu DTYPE M N K IN OUT, DTYPE a DT_* code of common.cuh. IN holds the weight rows
// (N × row bytes) then x (M × K f32); OUT gets y = x·wᵀ (M × N f32) by matvec_*, the same by
// matvec32_* (NaN where K is not a multiple of 32), the same from 8-bit activations by matvec_q8_*
// (NaN where there is none), then w as f32 (N × K), then w
// as f16 (N × K), then w as bf16 (N × K).
#define LAYERSTREAM_HOST_EMU
#include "emu.h"
#include "../cuda/common.cuh"
#include "../cuda/quant.cu"
#include "../cuda/int8.cu"
#include <cstdlib>

int main(int argc, char** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: quant-emu DTYPE M N K IN OUT\n");
        return 2;
    }
    const int t = atoi(argv[1]), m = atoi(argv[2]), n = atoi(argv[3]), k = atoi(argv[4]);
    const long long rb = row_bytes(t, k);
    if (rb < 0) return 2;
    std::vector<u8> w(rb * n);
    std::vector<float> x((size_t)m * k), y((size_t)m * n, NAN), d32((size_t)n * k, NAN);
    std::vector<u16> d16((size_t)n * k, 0xFFFF), dbf((size_t)n * k, 0xFFFF);
    FILE* in = fopen(argv[5], "rb");
    if (!in || !read_into(in, w) || !read_into(in, x)) return 3;
    fclose(in);
    // The launch shapes of kernels/src/cuda/backend.rs: a warp per output row, a thread per 8 elements.
    launch((n * 32 + 255) / 256, 256, [&] {
#define MATVEC(NAME, T) if (t == T) matvec_##NAME(w.data(), rb, x.data(), y.data(), m, n, k);
        MATVEC(f32, DT_F32) MATVEC(f16, DT_F16) MATVEC(bf16, DT_BF16) MATVEC(q8_0, DT_Q8_0)
        MATVEC(q4_0, DT_Q4_0) MATVEC(q4_1, DT_Q4_1) MATVEC(q4_k, DT_Q4_K) MATVEC(q6_k, DT_Q6_K)
        MATVEC(q5_0, DT_Q5_0) MATVEC(q5_1, DT_Q5_1) MATVEC(q2_k, DT_Q2_K) MATVEC(q3_k, DT_Q3_K)
        MATVEC(q5_k, DT_Q5_K) MATVEC(iq4_nl, DT_IQ4_NL) MATVEC(iq4_xs, DT_IQ4_XS)
    });
    // The wide-load kernel where the backend would use it (k a multiple of 32); NaN otherwise.
    std::vector<float> y32((size_t)m * n, NAN);
    if (k % 32 == 0) launch((n * 32 + 255) / 256, 256, [&] {
#define MATVEC32(NAME, T) if (t == T) matvec32_##NAME(w.data(), rb, x.data(), y32.data(), m, n, k);
        MATVEC32(f32, DT_F32) MATVEC32(f16, DT_F16) MATVEC32(bf16, DT_BF16) MATVEC32(q8_0, DT_Q8_0)
        MATVEC32(q4_0, DT_Q4_0) MATVEC32(q4_1, DT_Q4_1) MATVEC32(q4_k, DT_Q4_K) MATVEC32(q6_k, DT_Q6_K)
        MATVEC32(q5_0, DT_Q5_0) MATVEC32(q5_1, DT_Q5_1) MATVEC32(q2_k, DT_Q2_K) MATVEC32(q3_k, DT_Q3_K)
        MATVEC32(q5_k, DT_Q5_K) MATVEC32(iq4_nl, DT_IQ4_NL) MATVEC32(iq4_xs, DT_IQ4_XS)
    });
    // 8-bit activations where a kernel exists: x quantized by quantize_q8, then matvec_q8_*.
    std::vector<float> y8((size_t)m * n, NAN);
    const bool q8 = k % 32 == 0 && (t == DT_Q8_0 || t == DT_Q4_0 || t == DT_Q4_1 || t == DT_Q4_K || t == DT_Q6_K);
    if (q8) {
        const long long blocks = (long long)m * k / 32;
        std::vector<signed char> xq((size_t)m * k);
        std::vector<float> xd(blocks), xds(blocks);
        launch((blocks * 32 + 255) / 256, 256, [&] { quantize_q8(x.data(), xq.data(), xd.data(), xds.data(), blocks); });
        launch((n * 32 + 255) / 256, 256, [&] {
#define MATVEC_Q8(NAME, T) if (t == T) matvec_q8_##NAME(w.data(), rb, xq.data(), xd.data(), xds.data(), y8.data(), m, n, k);
            MATVEC_Q8(q8_0, DT_Q8_0) MATVEC_Q8(q4_0, DT_Q4_0) MATVEC_Q8(q4_1, DT_Q4_1) MATVEC_Q8(q4_k, DT_Q4_K)
            MATVEC_Q8(q6_k, DT_Q6_K)
        });
    }
    launch(((long long)n * k / 8 + 255) / 256 + 1, 256, [&] {
#define DEQUANT(NAME, T) if (t == T) { dequant_f32_##NAME(w.data(), rb, d32.data(), n, k); dequant_f16_##NAME(w.data(), rb, d16.data(), n, k); \
                                 dequant_bf16_##NAME(w.data(), rb, dbf.data(), n, k); }
        DEQUANT(f32, DT_F32) DEQUANT(f16, DT_F16) DEQUANT(bf16, DT_BF16) DEQUANT(q8_0, DT_Q8_0)
        DEQUANT(q4_0, DT_Q4_0) DEQUANT(q4_1, DT_Q4_1) DEQUANT(q4_k, DT_Q4_K) DEQUANT(q6_k, DT_Q6_K)
        DEQUANT(q5_0, DT_Q5_0) DEQUANT(q5_1, DT_Q5_1) DEQUANT(q2_k, DT_Q2_K) DEQUANT(q3_k, DT_Q3_K)
        DEQUANT(q5_k, DT_Q5_K) DEQUANT(iq4_nl, DT_IQ4_NL) DEQUANT(iq4_xs, DT_IQ4_XS)
    });
    FILE* out = fopen(argv[6], "wb");
    if (!out || !write_from(out, y) || !write_from(out, y32) || !write_from(out, y8) || !write_from(out, d32) || !write_from(out, d16) || !write_from(out, dbf)) return 3;
    return fclose(out) == 0 ? 0 : 3;
}
