// Shared device helpers: f16/bf16 conversion without headers (NVRTC compiles this file with no
// include path), warp and block reductions, and the dtype codes the Rust side passes.

#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2
#define DT_Q8_0 3
#define DT_Q4_0 4
#define DT_Q4_1 5
#define DT_Q4_K 6
#define DT_Q6_K 7
#define DT_Q5_0 8
#define DT_Q5_1 9
#define DT_Q2_K 10
#define DT_Q3_K 11
#define DT_Q5_K 12
#define DT_IQ4_NL 13
#define DT_IQ4_XS 14
#define DT_TQ1_0 15
#define DT_TQ2_0 16
#define DT_FP8_E4M3_B128 17
#define DT_INT8_B128 18
#define DT_INT4_G128 19
#define DT_MXFP4 20

typedef unsigned char u8;
typedef unsigned short u16;

#ifdef LAYERSTREAM_HOST_EMU
// Host emulation (kernels/emu, tests only): the same round-to-nearest conversions via _Float16.
__device__ __forceinline__ float h2f(u16 h) {
    _Float16 x;
    __builtin_memcpy(&x, &h, 2);
    return (float)x;
}

__device__ __forceinline__ u16 f2h(float f) {
    _Float16 x = (_Float16)f;
    u16 h;
    __builtin_memcpy(&h, &x, 2);
    return h;
}
#else
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// f32 → bf16 bits, rounded to nearest even (a NaN stays a NaN). Plain integer arithmetic: every
// architecture (cvt.rn.bf16.f32 needs sm_80) and the host emulator run this same code.
__device__ __forceinline__ u16 f2bf(float f) {
    const unsigned b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
    return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float ld_h(const u8* p) {
    return h2f(*(const u16*)p);
}

struct SumOp {
    static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
    static __device__ __forceinline__ float identity() { return 0.0f; }
};

struct MaxOp {
    static __device__ __forceinline__ float apply(float a, float b) { return fmaxf(a, b); }
    static __device__ __forceinline__ float identity() { return -3.0e38f; }
};

template <class Op> __device__ __forceinline__ float warp_reduce(float v) {
    for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce<SumOp>(v); }

// Block-wide reduction; blockDim.x must be a multiple of 32. Every thread gets the result.
template <class Op> __device__ float block_reduce(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_reduce<Op>(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < nw ? part[lane] : Op::identity();
    return warp_reduce<Op>(t);
}

__device__ float block_sum(float v) { return block_reduce<SumOp>(v); }
__device__ float block_max(float v) { return block_reduce<MaxOp>(v); }
