// Causal grouped-query attention of m new rows of one sequence over its KV cache (which already holds
// the new keys/values at positions start..start+m). One block per (head, row), walking the context in
// tiles of blockDim.x positions with an online softmax (running max and sum, the output rescaled as
// the max grows), so no scores buffer: memory does not grow with rows × heads × context.

#define ATT_MAX_THREADS 256
// head_dim ≤ ATT_DIMS_PER_THREAD × blockDim.x (the backend checks it).
#define ATT_DIMS_PER_THREAD 4

// window > 0: a row attends only to the last `window` positions of its context (itself included).
// anc != 0: the new rows are a token tree (at most 64: gridDim.y of them): row r attends
// to the cached positions before `start` and to the new rows whose bit is set in anc[r].
extern "C" __global__ void attention(const float* q, const float* kc, const float* vc, float* out,
                                     int start, int n_heads, int n_kv_heads, int hd, float scale, int window,
                                     const unsigned long long* anc) {
    __shared__ float p[ATT_MAX_THREADS];
    const int h = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int kvh = h / (n_heads / n_kv_heads);
    const int qd = n_heads * hd, kvd = n_kv_heads * hd;
    const int n_ctx = anc ? start + (int)gridDim.y : start + row + 1;
    const unsigned long long mask = anc ? anc[row] : 0ULL;
    const int first = window > 0 && n_ctx > window ? n_ctx - window : 0;
    const float* qv = q + (long long)row * qd + (long long)h * hd;
    float acc[ATT_DIMS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < ATT_DIMS_PER_THREAD; i++) acc[i] = 0.0f;
    float mx = -3.0e38f, sum = 0.0f;
    for (int t0 = first; t0 < n_ctx; t0 += nt) {
        const int t = t0 + tid;
        float s = -3.0e38f;
        const bool seen = t < n_ctx && (!anc || t < start || ((mask >> (t - start)) & 1ULL));
        if (seen) {
            const float* kv = kc + (long long)t * kvd + (long long)kvh * hd;
            float d = 0.0f;
            for (int j = 0; j < hd; j++) d += qv[j] * kv[j];
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
                const float* vp = vc + (long long)t0 * kvd + (long long)kvh * hd + d;
                float a = acc[i] * corr;
                for (int j = 0; j < n; j++) a += p[j] * vp[(long long)j * kvd];
                acc[i] = a;
            }
        }
        __syncthreads();  // every thread is done with p before the next tile overwrites it
    }
    const float inv = 1.0f / sum;
#pragma unroll
    for (int i = 0; i < ATT_DIMS_PER_THREAD; i++) {
        const int d = tid + i * nt;
        if (d < hd) out[(long long)row * qd + (long long)h * hd + d] = acc[i] * inv;
    }
}
