// Runs the block-reducing kernels of kernels/cuda (attention, rms_norm, argmax) under the host
// emulator, with the launch shapes of kernels/src/cuda/backend.rs. All data f32 unless said.
//   ops-emu attention START M NH NKV HD IN OUT   IN: q (M×NH·HD), k and v caches ((START+M)×NKV·HD)
//                                                OUT: attention output (M×NH·HD)
//   ops-emu rms_norm ROWS COLS G IN OUT          IN: x (ROWS×COLS), weight (G)   OUT: y (ROWS×COLS)
//   ops-emu argmax ROWS COLS IN OUT              IN: x (ROWS×COLS)               OUT: u32 per row
#define LAYERSTREAM_HOST_EMU
#include "emu.h"
#include "../cuda/common.cuh"
#include "../cuda/quant.cu"
#include "../cuda/ops.cu"
#include "../cuda/attention.cu"
#include <cstdlib>
#include <string>

template <class T> static int write_out(const char* path, const std::vector<T>& v) {
    FILE* out = fopen(path, "wb");
    if (!out || !write_from(out, v)) return 3;
    return fclose(out) == 0 ? 0 : 3;
}

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const std::string op = argv[1];
    std::vector<int> a;
    for (int i = 2; i < argc - 2; i++) a.push_back(atoi(argv[i]));
    FILE* in = fopen(argv[argc - 2], "rb");
    if (!in) return 3;
    const char* out = argv[argc - 1];
    if (op == "attention" && a.size() == 5) {
        const int start = a[0], m = a[1], nh = a[2], nkv = a[3], hd = a[4], ctx = start + m;
        std::vector<float> q((size_t)m * nh * hd), kc((size_t)ctx * nkv * hd), vc(kc.size());
        if (!read_into(in, q) || !read_into(in, kc) || !read_into(in, vc)) return 3;
        std::vector<float> o(q.size(), NAN);
        const float scale = 1.0f / sqrtf((float)hd);
        launch2(nh, m, 128, [&] { attention(q.data(), kc.data(), vc.data(), o.data(), start, nh, nkv, hd, scale); });
        return write_out(out, o);
    }
    if (op == "rms_norm" && a.size() == 3) {
        const int rows = a[0], cols = a[1], g = a[2];
        std::vector<float> x((size_t)rows * cols), w(g), y(x.size(), NAN);
        if (!read_into(in, x) || !read_into(in, w)) return 3;
        launch(rows * cols / g, g >= 256 ? 256 : 64, [&] { rms_norm(x.data(), y.data(), (const u8*)w.data(), DT_F32, g, 1e-5f); });
        return write_out(out, y);
    }
    if (op == "argmax" && a.size() == 2) {
        const int rows = a[0], cols = a[1];
        std::vector<float> x((size_t)rows * cols);
        std::vector<unsigned> idx(rows, 0xFFFFFFFFu);
        if (!read_into(in, x)) return 3;
        launch(rows, 256, [&] { argmax(x.data(), idx.data(), cols); });
        return write_out(out, idx);
    }
    fprintf(stderr, "usage: see the head of ops_main.cpp\n");
    return 2;
}
