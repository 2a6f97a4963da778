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
        EVERY_DTYPE(MATVEC)
    });
    // The wide-load kernel where the backend would use it (k a multiple of 32); NaN otherwise.
    std::vector<float> y32((size_t)m * n, NAN);
    if (k % 32 == 0) launch((n * 32 + 255) / 256, 256, [&] {
#define MATVEC32(NAME, T) if (t == T) matvec32_##NAME(w.data(), rb, x.data(), y32.data(), m, n, k);
        EVERY_DTYPE(MATVEC32)
    });
    // 8-bit activations where a kernel exists: x quantized by quantize_q8, then matvec_q8_*.
    std::vector<float> y8((size_t)m * n, NAN);
#define IS(NAME, T) || t == T
    const bool q8 = k % 32 == 0 && (false Q8_DTYPES(IS));
    if (q8) {
        const long long blocks = (long long)m * k / 32;
        std::vector<signed char> xq((size_t)m * k);
        std::vector<float> xd(blocks), xds(blocks);
        launch((blocks * 32 + 255) / 256, 256, [&] { quantize_q8(x.data(), xq.data(), xd.data(), xds.data(), blocks); });
        launch((n * 32 + 255) / 256, 256, [&] {
#define MATVEC_Q8(NAME, T) if (t == T) matvec_q8_##NAME(w.data(), rb, xq.data(), xd.data(), xds.data(), y8.data(), m, n, k);
            Q8_DTYPES(MATVEC_Q8)
        });
    }
    launch(((long long)n * k / 8 + 255) / 256 + 1, 256, [&] {
#define DEQUANT(NAME, T) if (t == T) { dequant_f32_##NAME(w.data(), rb, d32.data(), n, k); dequant_f16_##NAME(w.data(), rb, d16.data(), n, k); \
                                 dequant_bf16_##NAME(w.data(), rb, dbf.data(), n, k); }
        EVERY_DTYPE(DEQUANT)
    });
    FILE* out = fopen(argv[6], "wb");
    if (!out || !write_from(out, y) || !write_from(out, y32) || !write_from(out, y8) || !write_from(out, d32) || !write_from(out, d16) || !write_from(out, dbf)) return 3;
    return fclose(out) == 0 ? 0 : 3;
}
