// Causal grouped-query attention of m new rows of one sequence over its KV cache (which already holds
// the new keys/values at positions start..start+m). One block per (head, row); scores go to a global
// scratch row of ctx_stride floats, so the context length is bounded by memory, not shared memory.

extern "C" __global__ void attention(const float* q, const float* kc, const float* vc, float* out, float* scores,
                                     int start, int n_heads, int n_kv_heads, int hd, int ctx_stride, float scale) {
    int h = blockIdx.x, row = blockIdx.y;
    int kvh = h / (n_heads / n_kv_heads);
    int qd = n_heads * hd, kvd = n_kv_heads * hd;
    int n_ctx = start + row + 1;
    const float* qv = q + (long long)row * qd + (long long)h * hd;
    float* s = scores + ((long long)row * n_heads + h) * ctx_stride;
    for (int t = threadIdx.x; t < n_ctx; t += blockDim.x) {
        const float* kv = kc + (long long)t * kvd + (long long)kvh * hd;
        float acc = 0.0f;
        for (int d = 0; d < hd; d++) acc += qv[d] * kv[d];
        s[t] = acc * scale;
    }
    __syncthreads();
    float mx = -3.0e38f;
    for (int t = threadIdx.x; t < n_ctx; t += blockDim.x) mx = fmaxf(mx, s[t]);
    mx = block_max(mx);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < n_ctx; t += blockDim.x) {
        float e = expf(s[t] - mx);
        s[t] = e;
        sum += e;
    }
    sum = block_sum(sum);
    __syncthreads();
    float inv = 1.0f / sum;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        const float* vp = vc + (long long)kvh * hd + d;
        for (int t = 0; t < n_ctx; t++) acc += s[t] * inv * vp[(long long)t * kvd];
        out[(long long)row * qd + (long long)h * hd + d] = acc;
    }
}
