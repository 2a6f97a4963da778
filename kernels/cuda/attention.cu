// Grouped-query attention of m new rows of one sequence over a paged KV pool, and the kernel that
// stores those rows. A pool holds blocks of `bs` positions; row t of a sequence lives in block
// table[t / bs] at offset t % bs, `stride` bytes per stored row, in dtype `dt` (DT_F32, DT_F16,
// DT_BF16, DT_Q8_0 or DT_Q4_0 of common.cuh: the quantized ones in blocks of 32 values, a row of
// keys or values whole blocks). Attention: one block per (head, row), walking the context in tiles of
// blockDim.x positions with an online softmax (running max and sum, the output rescaled as the max
// grows), so no scores buffer: memory does not grow with rows × heads × context.

#define ATT_MAX_THREADS 256
// head_dim ≤ ATT_DIMS_PER_THREAD × blockDim.x (the backend checks it).
#define ATT_DIMS_PER_THREAD 5

// The stored row of position t.
__device__ __forceinline__ const u8* kv_row(const u8* pool, const unsigned* table, int bs, long long stride, int t) {
    return pool + ((long long)table[t / bs] * bs + t % bs) * stride;
}

// The normalized Walsh-Hadamard transform of n values in place (n a power of two): quantized
// pools store every head's keys and values rotated in chunks of `rot` (kernels/src/kv.rs
// `rotation`), the query is rotated the same way and the output rotated back.
__device__ __forceinline__ void fwht(float* c, int n) {
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = c[j], b = c[j + h];
                c[j] = a + b;
                c[j + h] = a - b;
            }
    const float scale = 1.0f / sqrtf((float)n);
    for (int j = 0; j < n; j++) c[j] *= scale;
}

// Element j of a stored row.
__device__ __forceinline__ float kv_at(const u8* row, int j, int dt) {
    switch (dt) {
        case DT_F32: return ((const float*)row)[j];
        case DT_F16: return h2f(((const u16*)row)[j]);
        case DT_BF16: return __uint_as_float((unsigned)((const u16*)row)[j] << 16);
        case DT_Q8_0: {
            const u8* b = row + (j / 32) * 34;
            return ld_h(b) * (float)(signed char)b[2 + j % 32];
        }
        default: {  // DT_Q4_0
            const u8* b = row + (j / 32) * 18;
            const int l = j % 32;
            const int q = l < 16 ? (b[2 + l] & 0xF) : (b[2 + l - 16] >> 4);
            return ld_h(b) * (float)(q - 8);
        }
    }
}

// Stores rows src[m, kvd] (f32) at positions start..start+m: one block per row; each thread one
// value (plain dtypes) or one span of max(rot, 32) values, rotated in chunks of `rot` (0: not) and
// quantized in groups of 32 (as ggml's reference quantizers).
extern "C" __global__ void kv_store(const float* src, u8* pool, const unsigned* table, int start, int kvd,
                                    int bs, long long stride, int dt, int rot) {
    const int r = blockIdx.x;
    const float* x = src + (long long)r * kvd;
    u8* row = pool + ((long long)table[(start + r) / bs] * bs + (start + r) % bs) * stride;
    if (dt == DT_F32 || dt == DT_F16 || dt == DT_BF16) {
        for (int j = threadIdx.x; j < kvd; j += blockDim.x) {
            if (dt == DT_F32) ((float*)row)[j] = x[j];
            else if (dt == DT_F16) ((u16*)row)[j] = f2h(x[j]);
            else ((u16*)row)[j] = f2bf(x[j]);
        }
        return;
    }
    const int span = rot > 32 ? rot : 32;
    for (int sp = threadIdx.x; sp < kvd / span; sp += blockDim.x) {
        float buf[64];
        for (int l = 0; l < span; l++) buf[l] = x[sp * span + l];
        if (rot > 1)
            for (int c = 0; c < span; c += rot) fwht(buf + c, rot);
        for (int part = 0; part < span / 32; part++) {
        const int g = sp * (span / 32) + part;
        const float* v = buf + part * 32;
        if (dt == DT_Q8_0) {
            float amax = 0.0f;
            for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(v[l]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            u8* b = row + g * 34;
            // One 16-bit store (blocks of 34 bytes in rows of even stride: 2-byte aligned, as ld_h
            // reads it). Two byte stores of the halves left the low byte 0 on an H200 (NVRTC,
            // CUDA 13, 2026-11-27) while the host emulator wrote it.
            *(u16*)b = f2h(d);
            for (int l = 0; l < 32; l++) b[2 + l] = (u8)(signed char)roundf(v[l] * id);
        } else {  // DT_Q4_0: the value of largest magnitude, sign kept, maps to -8
            float mx = 0.0f;
            for (int l = 0; l < 32; l++) if (fabsf(v[l]) > fabsf(mx)) mx = v[l];
            const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            u8* b = row + g * 18;
            *(u16*)b = f2h(d);  // as Q8_0's
            for (int l = 0; l < 16; l++) {
                const int a = min(15, max(0, (int)(v[l] * id + 8.5f)));
                const int c = min(15, max(0, (int)(v[l + 16] * id + 8.5f)));
                b[2 + l] = (u8)(a | (c << 4));
            }
        }
        }
    }
}

// window > 0: a row attends only to the last `window` positions of its context (itself included).
// anc != 0: the new rows are (the end of) a token tree: row r attends to the positions before
// `tree_from` and to the tree's positions `tree_from + j` whose bit j is set in anc[r] (rows an
// earlier call cached from `tree_from` to `start`, then the new ones; at most 64 in all).
// rot > 1: keys and values are stored rotated in chunks of `rot` (see fwht): the query is rotated
// before the scores and the output rotated back.
// sinks != 0: head h's softmax counts exp(sinks[h]) in its denominator (gpt-oss): the online
// softmax starts from max = sinks[h], sum = 1 instead of an empty state.
extern "C" __global__ void attention(const float* q, const u8* kp, const u8* vp, const unsigned* table, int bs,
                                     long long stride, int dt, int rot, float* out, int start, int n_heads,
                                     int n_kv_heads, int hd, float scale, int window,
                                     const unsigned long long* anc, const float* sinks, int tree_from) {
    __shared__ float p[ATT_MAX_THREADS];
    __shared__ float rq[ATT_DIMS_PER_THREAD * ATT_MAX_THREADS];
    const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int kvh = h / (n_heads / n_kv_heads);
    const int qd = n_heads * hd;
    const int n_ctx = anc ? start + (int)gridDim.y : start + row + 1;
    const unsigned long long mask = anc ? anc[row] : 0ULL;
    const int first = window > 0 && n_ctx > window ? n_ctx - window : 0;
    const float* qv = q + (long long)row * qd + (long long)h * hd;
    if (rot > 1) {
        for (int j = tid; j < hd; j += nt) rq[j] = qv[j];
        __syncthreads();
        if (tid == 0)
            for (int c = 0; c < hd; c += rot) fwht(rq + c, rot);
        __syncthreads();
        qv = rq;
    }
    float acc[ATT_DIMS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < ATT_DIMS_PER_THREAD; i++) acc[i] = 0.0f;
    float mx = sinks ? sinks[h] : -3.0e38f, sum = sinks ? 1.0f : 0.0f;
    for (int t0 = first; t0 < n_ctx; t0 += nt) {
        const int t = t0 + tid;
        float s = -3.0e38f;
        const bool seen = t < n_ctx && (!anc || t < tree_from || ((mask >> (t - tree_from)) & 1ULL));
        if (seen) {
            const u8* kr = kv_row(kp, table, bs, stride, t);
            float d = 0.0f;
            for (int j = 0; j < hd; j++) d += qv[j] * kv_at(kr, kvh * hd + j, dt);
            s = d * scale;
        }
        const float mx_new = fmaxf(mx, block_max(s));
        const float e = seen ? expf(s - mx_new) : 0.0f;
        const float tile_sum = block_sum(e);
        p[tid] = e;
        __syncthreads();
        const float corr = expf(mx - mx_new);
        sum = sum * corr + tile_sum;
        mx = mx_new;
        const int n = min(nt, n_ctx - t0);
#pragma unroll
        for (int i = 0; i < ATT_DIMS_PER_THREAD; i++) {
            const int d = tid + i * nt;
            if (d < hd) {
                float a = acc[i] * corr;
                for (int j = 0; j < n; j++) a += p[j] * kv_at(kv_row(vp, table, bs, stride, t0 + j), kvh * hd + d, dt);
                acc[i] = a;
            }
        }
        __syncthreads();  // every thread is done with p before the next tile overwrites it
    }
    const float inv = 1.0f / sum;
    float* o = out + (long long)row * qd + (long long)h * hd;
    if (rot > 1) {
        // The output is rotated back (the query's copy is no longer read: its buffer serves).
#pragma unroll
        for (int i = 0; i < ATT_DIMS_PER_THREAD; i++) {
            const int d = tid + i * nt;
            if (d < hd) rq[d] = acc[i] * inv;
        }
        __syncthreads();
        if (tid == 0)
            for (int c = 0; c < hd; c += rot) fwht(rq + c, rot);
        __syncthreads();
        for (int d = tid; d < hd; d += nt) o[d] = rq[d];
        return;
    }
#pragma unroll
    for (int i = 0; i < ATT_DIMS_PER_THREAD; i++) {
        const int d = tid + i * nt;
        if (d < hd) o[d] = acc[i] * inv;
    }
}
