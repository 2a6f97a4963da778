// A minimal CUDA execution model on the host, so the .cu kernels can be checked against the CPU
// backend where there is no GPU (tests only; see kernels/src/cuda/tests_emu.rs). One OS thread per CUDA
// thread, blocks one after another (so __shared__ can be a static), the threads of a warp meeting at
// a barrier for each shuffle, and __syncthreads a block-wide barrier that exited threads leave.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using std::max;
using std::min;
struct dim_ { unsigned x, y, z; };
inline thread_local dim_ threadIdx, blockIdx;
inline dim_ blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __constant__ static const
struct WarpSync { std::barrier<> bar{32}; float f[32]; int i[32]; };
inline std::barrier<>* g_block;
inline std::vector<std::unique_ptr<WarpSync>>* g_warps;
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    auto& w = *(*g_warps)[threadIdx.x >> 5]; int l = threadIdx.x & 31;
    w.f[l] = v; w.bar.arrive_and_wait(); float r = w.f[l ^ o]; w.bar.arrive_and_wait(); return r;
}
inline int __shfl_xor_sync(unsigned, int v, int o) {
    auto& w = *(*g_warps)[threadIdx.x >> 5]; int l = threadIdx.x & 31;
    w.i[l] = v; w.bar.arrive_and_wait(); int r = w.i[l ^ o]; w.bar.arrive_and_wait(); return r;
}
// Four signed byte products added to c.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
// Runs `kernel` on a grid of gx × gy blocks of `block` threads (blocks in order, x fastest).
template <class F> void launch2(unsigned gx, unsigned gy, unsigned block, F kernel) {
    gridDim = {gx, gy, 1}; blockDim = {block, 1, 1};
    for (unsigned b = 0; b < gx * gy; b++) {
        std::barrier<> bb(block);
        std::vector<std::unique_ptr<WarpSync>> ws;
        for (unsigned w = 0; w < (block + 31) / 32; w++) ws.push_back(std::make_unique<WarpSync>());
        g_block = &bb; g_warps = &ws;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; t++) ts.emplace_back([&, t, b] { threadIdx = {t, 0, 0}; blockIdx = {b % gx, b / gx, 0}; kernel(); bb.arrive_and_drop(); });
        for (auto& t : ts) t.join();
    }
}
template <class F> void launch(unsigned grid, unsigned block, F kernel) { launch2(grid, 1, block, kernel); }
// Bytes of one stored row of k elements of dtype t (a DT_* code of common.cuh); -1 for an unknown
// dtype or a width that is not whole blocks.
inline long long row_bytes(int t, long long k) {
    // Indexed by the DT_* codes of common.cuh.
    const int elems[] = {1, 1, 1, 32, 32, 32, 256, 256, 32, 32, 256, 256, 256, 32, 256, 256, 256, 128, 128, 128, 32};
    const int bytes[] = {4, 2, 2, 34, 18, 20, 144, 210, 22, 24, 84, 110, 176, 18, 136, 54, 66, 132, 132, 69, 17};
    if (t < 0 || t > 20 || k % elems[t] != 0) return -1;
    return k / elems[t] * bytes[t];
}
// Reads exactly v.size() elements of v's type from f; false on a short file.
template <class T> bool read_into(FILE* f, std::vector<T>& v) { return fread(v.data(), sizeof(T), v.size(), f) == v.size(); }
// Writes all of v to f; false on a short write.
template <class T> bool write_from(FILE* f, const std::vector<T>& v) { return fwrite(v.data(), sizeof(T), v.size(), f) == v.size(); }
