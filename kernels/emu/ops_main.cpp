// Runs the kernels of kernels/cuda/ops.cu and attention.cu under the host emulator, with the launch
// shapes of kernels/src/cuda/backend.rs. All data f32 unless said; T is a DT_* code of common.cuh.
//   ops-emu attention START M NH NKV HD THREADS WINDOW SCALAR BS T NB TREE SINKS TREE_FROM IN OUT
//                                                (scale 1/√SCALAR; a pool of blocks of BS positions
//                                                in dtype T; the sequence's table names NB blocks)
//                                                IN: q (M×NH·HD), k and v rows ((START+M)×NKV·HD),
//                                                NB u32 block ids, with TREE M u64 ancestor masks,
//                                                with SINKS NH f32 sink logits
//                                                OUT: attention output (M×NH·HD) — the START rows
//                                                stored first (kv_store), then the M new ones
//   ops-emu rms_norm ROWS COLS G IN OUT          IN: x (ROWS×COLS), weight (G)   OUT: y (ROWS×COLS)
//   ops-emu argmax ROWS COLS IN OUT              IN: x (ROWS×COLS)               OUT: u32 per row
//   ops-emu embedding T VOCAB COLS N IN OUT      IN: table (VOCAB rows of T), N u32 ids   OUT: N×COLS
//   ops-emu rope ROWS COLS HD IN OUT             IN: x (ROWS×COLS), i32 position per row, HD/2
//                                                inverse frequencies, the attention factor
//                                                                                OUT: rotated x
//   ops-emu silu_mul N IN OUT                    IN: gate (N), up (N)            OUT: silu(gate)·up
//   ops-emu gelu_tanh_mul N IN OUT               IN: gate (N), up (N)            OUT: gelu_tanh(gate)·up
//   ops-emu relu2_mul N IN OUT                   IN: gate (N), up (N)            OUT: relu(gate)²·up
//   ops-emu swiglu_clamp_mul N IN OUT            IN: gate (N), up (N)            OUT: gpt-oss's clamped
//                                                SwiGLU (alpha 1.702, limit 7)
//   ops-emu quant_rows_8bit ROWS COLS IN OUT     IN: x (ROWS×COLS)               OUT: 8-bit rounded rows
//   ops-emu copy_cols ROWS SC SO DC DO N IN OUT  IN: src (ROWS×SC), dst (ROWS×DC)  OUT: dst with its
//                                                columns DO.. = src's SO.. (N of them)
//   ops-emu permute_cols ROWS COLS IN OUT        IN: x (ROWS×COLS), COLS i32 order  OUT: x[r, perm[j]]
//   ops-emu add N IN OUT                         IN: x (N), y (N)                OUT: x + y
//   ops-emu gather_rows ROWS COLS N IN OUT       IN: x (ROWS×COLS), N i32 row ids  OUT: N×COLS
//   ops-emu add_rows_scaled ROWS COLS N IN OUT   IN: acc (ROWS×COLS), y (N×COLS), N i32 row ids,
//                                                N f32 scales                    OUT: acc
//   ops-emu add_bias T ROWS COLS IN OUT          IN: x (ROWS×COLS), bias (a row of T)  OUT: x + bias
//   ops-emu to_f16 N IN OUT                      IN: x (N)                       OUT: N f16 bit patterns
//   ops-emu sample ROWS COLS NSEEN IN OUT        IN: x (ROWS×COLS), ROWS×4 f32 (temperature, top-p,
//                                                penalty, draw), ROWS×3 i32 (top-k, seen start, end),
//                                                NSEEN i32 ids  OUT: i32 per row, then penalised x
//   ops-emu to_bf16 N IN OUT                     IN: x (N)                       OUT: N bf16 bit patterns
#define LAYERSTREAM_HOST_EMU
#include "emu.h"
#include "../cuda/common.cuh"
#include "../cuda/quant.cu"
#include "../cuda/ops.cu"
#include "../cuda/attention.cu"
#include "../cuda/sample.cu"
#include <cstdlib>
#include <string>

// The grid backend.rs gives an element-wise kernel over n values: 256-thread blocks, at most 2^20.
static unsigned grid_for(long long n) { return (unsigned)std::clamp((n + 255) / 256, 1LL, 1LL << 20); }

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
    if (op == "attention" && a.size() == 14) {
        const int start = a[0], m = a[1], nh = a[2], nkv = a[3], hd = a[4], threads = a[5], window = a[6];
        const int bs = a[8], dt = a[9], nb = a[10], tree = a[11], has_sinks = a[12], ctx = start + m, kvd = nkv * hd;
        std::vector<float> q((size_t)m * nh * hd), k((size_t)ctx * kvd), v(k.size()), sinks(has_sinks ? nh : 0);
        std::vector<unsigned> table(nb);
        std::vector<unsigned long long> anc(tree ? m : 0);
        if (!read_into(in, q) || !read_into(in, k) || !read_into(in, v) || !read_into(in, table) || !read_into(in, anc) || !read_into(in, sinks)) return 3;
        const long long stride = (row_bytes(dt, kvd) + 3) / 4 * 4;
        // The backend's rotation (kernels/src/kv.rs `rotation`): quantized dtypes, chunks of the
        // largest power of two dividing head_dim, at most 64.
        const int rot = (dt == DT_Q8_0 || dt == DT_Q4_0) ? std::min(64, hd & -hd) : 0;
        const unsigned most = *std::max_element(table.begin(), table.end()) + 1;
        std::vector<u8> kp((size_t)most * bs * stride), vp(kp.size());
        // The backend's launches: kv_store for keys and values (the cached rows, then the new), then attention.
        for (auto [from, n] : {std::pair{0, start}, std::pair{start, m}}) {
            if (n == 0) continue;
            launch(n, 64, [&] { kv_store(k.data() + (size_t)from * kvd, kp.data(), table.data(), from, kvd, bs, stride, dt, rot); });
            launch(n, 64, [&] { kv_store(v.data() + (size_t)from * kvd, vp.data(), table.data(), from, kvd, bs, stride, dt, rot); });
        }
        std::vector<float> o(q.size(), NAN);
        const float scale = 1.0f / sqrtf((float)a[7]);
        launch2(nh, m, threads, [&] { attention(q.data(), kp.data(), vp.data(), table.data(), bs, stride, dt, rot, o.data(), start, nh, nkv, hd, scale, window, tree ? anc.data() : nullptr, has_sinks ? sinks.data() : nullptr, a[13]); });
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
    if (op == "sample" && a.size() == 3) {
        const int rows = a[0], cols = a[1], nseen = a[2];
        std::vector<float> x((size_t)rows * cols), fp((size_t)rows * 4);
        std::vector<int> ip((size_t)rows * 3), seen(nseen), tok(rows, -3);
        if (!read_into(in, x) || !read_into(in, fp) || !read_into(in, ip) || !read_into(in, seen)) return 3;
        launch(rows, 256, [&] { sample_rows(x.data(), cols, fp.data(), ip.data(), seen.data(), tok.data()); });
        FILE* o = fopen(out, "wb");
        if (!o || !write_from(o, tok) || !write_from(o, x)) return 3;
        return fclose(o) == 0 ? 0 : 3;
    }
    if (op == "embedding" && a.size() == 4) {
        const int t = a[0], vocab = a[1], cols = a[2], n = a[3];
        const long long rb = row_bytes(t, cols);
        if (rb < 0) return 2;
        std::vector<u8> table(rb * vocab);
        std::vector<unsigned> ids(n);
        if (!read_into(in, table) || !read_into(in, ids)) return 3;
        std::vector<float> o((size_t)n * cols, NAN);
        launch(n, 256, [&] { embedding(table.data(), t, rb, ids.data(), o.data(), cols); });
        return write_out(out, o);
    }
    if ((op == "gather_rows" || op == "add_rows_scaled") && a.size() == 3) {
        const int rows = a[0], cols = a[1], n = a[2];
        const bool gather = op == "gather_rows";
        std::vector<float> x((size_t)rows * cols), y(gather ? 0 : (size_t)n * cols), sc(gather ? 0 : n);
        std::vector<int> idx(n);
        if (!read_into(in, x) || !read_into(in, y) || !read_into(in, idx) || !read_into(in, sc)) return 3;
        if (gather) {
            std::vector<float> o((size_t)n * cols, NAN);
            launch(n, 256, [&] { gather_rows(x.data(), idx.data(), o.data(), n, cols); });
            return write_out(out, o);
        }
        launch(n, 256, [&] { add_rows_scaled(x.data(), y.data(), idx.data(), sc.data(), n, cols); });
        return write_out(out, x);
    }
    if (op == "rope" && a.size() == 3) {
        const int rows = a[0], cols = a[1], hd = a[2];
        std::vector<float> x((size_t)rows * cols), inv(hd / 2), af(1);
        std::vector<int> pos(rows);
        if (!read_into(in, x) || !read_into(in, pos) || !read_into(in, inv) || !read_into(in, af)) return 3;
        launch(grid_for((long long)rows * (cols / hd) * (hd / 2)), 256, [&] { rope(x.data(), pos.data(), inv.data(), rows, cols, hd, af[0]); });
        return write_out(out, x);
    }
    const bool to_half = op == "to_f16" || op == "to_bf16";
    if (op == "copy_cols" && a.size() == 6) {
        const int rows = a[0], sc = a[1], so = a[2], dc = a[3], dof = a[4], n = a[5];
        std::vector<float> src((size_t)rows * sc), dst((size_t)rows * dc);
        if (!read_into(in, src) || !read_into(in, dst)) return 3;
        launch(grid_for((long long)rows * n), 256, [&] { copy_cols(src.data(), sc, so, dst.data(), dc, dof, rows, n); });
        return write_out(out, dst);
    }
    if (op == "permute_cols" && a.size() == 2) {
        const int rows = a[0], cols = a[1];
        std::vector<float> x((size_t)rows * cols), y((size_t)rows * cols, NAN);
        std::vector<int> perm(cols);
        if (!read_into(in, x) || !read_into(in, perm)) return 3;
        launch(rows, 256, [&] { permute_cols(x.data(), perm.data(), y.data(), rows, cols); });
        return write_out(out, y);
    }
    if (op == "quant_rows_8bit" && a.size() == 2) {
        const int rows = a[0], cols = a[1];
        std::vector<float> x((size_t)rows * cols), y((size_t)rows * cols, NAN);
        if (!read_into(in, x)) return 3;
        launch(rows, 256, [&] { quant_rows_8bit(x.data(), y.data(), cols); });
        return write_out(out, y);
    }
    if ((op == "silu_mul" || op == "gelu_tanh_mul" || op == "relu2_mul" || op == "swiglu_clamp_mul" || op == "add" || to_half) && a.size() == 1) {
        const long long n = a[0];
        std::vector<float> x(n), y(to_half ? 0 : n), o(n, NAN);
        if (!read_into(in, x) || !read_into(in, y)) return 3;
        if (to_half) {
            std::vector<u16> h(n, 0xFFFF);
            launch(grid_for(n), 256, [&] { op == "to_f16" ? to_f16(x.data(), h.data(), n) : to_bf16(x.data(), h.data(), n); });
            return write_out(out, h);
        }
        if (op == "add") {
            launch(grid_for(n), 256, [&] { add(x.data(), y.data(), n); });
            return write_out(out, x);
        }
        if (op == "gelu_tanh_mul") {
            launch(grid_for(n), 256, [&] { gelu_tanh_mul(x.data(), y.data(), o.data(), n); });
            return write_out(out, o);
        }
        if (op == "relu2_mul") {
            launch(grid_for(n), 256, [&] { relu2_mul(x.data(), y.data(), o.data(), n); });
            return write_out(out, o);
        }
        if (op == "swiglu_clamp_mul") {
            // gpt-oss's alpha and limit.
            launch(grid_for(n), 256, [&] { swiglu_clamp_mul(x.data(), y.data(), o.data(), n, 1.702f, 7.0f); });
            return write_out(out, o);
        }
        launch(grid_for(n), 256, [&] { silu_mul(x.data(), y.data(), o.data(), n); });
        return write_out(out, o);
    }
    if (op == "add_bias" && a.size() == 3) {
        const int t = a[0], rows = a[1], cols = a[2];
        const long long rb = row_bytes(t, cols), n = (long long)rows * cols;
        if (rb < 0) return 2;
        std::vector<float> x(n);
        std::vector<u8> b(rb);
        if (!read_into(in, x) || !read_into(in, b)) return 3;
        launch(grid_for(n), 256, [&] { add_bias(x.data(), b.data(), t, n, cols); });
        return write_out(out, x);
    }
    fprintf(stderr, "usage: see the head of ops_main.cpp\n");
    return 2;
}
