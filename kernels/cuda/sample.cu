// Sampling on the device, one block per row of logits, picking exactly what the host's
// `sampling::choose` picks from the same uniform draw (up to the rounding of sums taken in another
// order): repetition penalty in place, then argmax at temperature 0; the whole tempered distribution
// walked in id order when nothing truncates; otherwise the top-k / top-p candidates (a threshold
// found by bisection over order-preserving keys, at most SAMPLE_CAP of them) gathered, sorted most
// likely first (lower id first among equals), renormalised and walked with sums in the host's order.
// Per-row results: the token id, -1 where the candidates exceed SAMPLE_CAP (the host samples that
// row from the already penalised logits), -2 where a logit is not finite.

#define SAMPLE_CAP 2048

// A float's bits mapped so that larger floats have larger keys (finite floats: keys above 0).
__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// How many values of row have a key of at least `key` (exact: counts below 2^24).
__device__ int count_at_least(const float* row, int cols, unsigned key) {
    float n = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) n += order_key(row[c]) >= key ? 1.0f : 0.0f;
    return (int)block_sum(n);
}

// The probability mass (exp(l/t − m)/s) of the values of row with a key of at least `key`.
__device__ float mass_at_least(const float* row, int cols, unsigned key, float t, float m, float s) {
    float p = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float l = row[c];
        if (order_key(l) >= key) p += expf(l / t - m) / s;
    }
    return block_sum(p);
}

// rows: one block each. fp[4r..]: temperature, top-p, repetition penalty, uniform draw; ip[3r..]:
// top-k (-1: skip the row, writing 0), first and end of the row's penalised ids in `seen`.
extern "C" __global__ void sample_rows(float* x, int cols, const float* fp, const int* ip, const int* seen, int* out) {
    const int r = blockIdx.x;
    float* row = x + (long long)r * cols;
    const float t = fp[4 * r], top_p = fp[4 * r + 1], penalty = fp[4 * r + 2], u = fp[4 * r + 3];
    const int top_k = ip[3 * r], s0 = ip[3 * r + 1], s1 = ip[3 * r + 2];
    if (top_k < 0) {
        if (threadIdx.x == 0) out[r] = 0;
        return;
    }
    float bad = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) bad = fabsf(row[c]) <= 3.402823466e38f ? bad : 1.0f;
    if (block_max(bad) > 0.0f) {
        if (threadIdx.x == 0) out[r] = -2;
        return;
    }
    if (penalty != 1.0f) {
        for (int i = s0 + threadIdx.x; i < s1; i += blockDim.x) {
            const int id = seen[i];
            if (id >= 0 && id < cols) row[id] = row[id] > 0.0f ? row[id] / penalty : row[id] * penalty;
        }
    }
    __syncthreads();
    const int best = block_argmax(row, cols);
    if (t == 0.0f) {
        if (threadIdx.x == 0) out[r] = best;
        return;
    }
    const float m = row[best] / t;
    float part = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) part += expf(row[c] / t - m);
    const float s = block_sum(part);

    __shared__ float chunk_sum[1024];
    __shared__ int cnt_gt[1024], cnt_eq[1024];
    if (top_k == 0 && top_p >= 1.0f) {
        // Untruncated: ids in order, each thread a contiguous chunk; the thread whose chunk holds
        // the crossing walks it.
        const int per = (cols + blockDim.x - 1) / blockDim.x, c0 = threadIdx.x * per, c1 = min(cols, c0 + per);
        float local = 0.0f, last = -1.0f;
        for (int c = c0; c < c1; c++) {
            const float p = expf(row[c] / t - m) / s;
            local += p;
            if (p > 0.0f) last = (float)c;
        }
        chunk_sum[threadIdx.x] = local;
        const float last_pos = block_max(last);
        __syncthreads();
        if (threadIdx.x == 0) {
            float base = 0.0f;
            for (int j = 0; j < (int)blockDim.x; j++) {
                const float v = chunk_sum[j];
                chunk_sum[j] = base;
                base += v;
            }
            out[r] = (int)last_pos;
        }
        __syncthreads();
        const float base = chunk_sum[threadIdx.x];
        if (base <= u && u < base + local) {
            float run = 0.0f;
            for (int c = c0; c < c1; c++) {
                run += expf(row[c] / t - m) / s;
                if (u < base + run) {
                    out[r] = c;
                    break;
                }
            }
        }
        return;
    }

    // The threshold key: top-k's k-th largest, or top-p's lowest key whose mass (with a margin for
    // sums in another order) reaches top-p.
    const int k = top_k > 0 ? min(top_k, cols) : 0;
    const float want = fminf(top_p + 1e-3f, 1.0f);
    unsigned key = 0;
    for (int bit = 31; bit >= 0; bit--) {
        const unsigned cand = key | (1u << bit);
        const bool keep = k > 0 ? count_at_least(row, cols, cand) >= k : mass_at_least(row, cols, cand, t, m, s) >= want;
        if (keep) key = cand;
    }
    // Gather: keys above the threshold, and at it the lowest ids (all of them for top-p).
    const int per = (cols + blockDim.x - 1) / blockDim.x, c0 = threadIdx.x * per, c1 = min(cols, c0 + per);
    int gt = 0, eq = 0;
    for (int c = c0; c < c1; c++) {
        const unsigned kc = order_key(row[c]);
        gt += kc > key;
        eq += kc == key;
    }
    cnt_gt[threadIdx.x] = gt;
    cnt_eq[threadIdx.x] = eq;
    __shared__ int totals[2];
    __syncthreads();
    if (threadIdx.x == 0) {
        int bg = 0, be = 0;
        for (int j = 0; j < (int)blockDim.x; j++) {
            const int g = cnt_gt[j], e = cnt_eq[j];
            cnt_gt[j] = bg, cnt_eq[j] = be;
            bg += g, be += e;
        }
        totals[0] = bg, totals[1] = be;
    }
    __syncthreads();
    const int n_gt = totals[0], need_eq = k > 0 ? max(0, k - n_gt) : totals[1];
    const int n = n_gt + min(need_eq, totals[1]);
    if (n > SAMPLE_CAP || n == 0) {
        if (threadIdx.x == 0) out[r] = -1;
        return;
    }
    __shared__ unsigned keys[SAMPLE_CAP];
    __shared__ int ids[SAMPLE_CAP];
    __shared__ float probs[SAMPLE_CAP];
    int pg = cnt_gt[threadIdx.x], pe = cnt_eq[threadIdx.x];
    for (int c = c0; c < c1; c++) {
        const unsigned kc = order_key(row[c]);
        if (kc > key) {
            keys[pg] = kc, ids[pg] = c, pg++;
        } else if (kc == key) {
            if (pe < need_eq) keys[n_gt + pe] = kc, ids[n_gt + pe] = c;
            pe++;
        }
    }
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + threadIdx.x; i < size; i += blockDim.x) keys[i] = 0, ids[i] = 0x7fffffff;
    __syncthreads();
    // Bitonic sort: larger key first, lower id first among equal keys.
    for (int len = 2; len <= size; len <<= 1) {
        for (int j = len >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < size; i += blockDim.x) {
                const int o = i ^ j;
                if (o > i) {
                    const bool first = keys[i] > keys[o] || (keys[i] == keys[o] && ids[i] < ids[o]);
                    const bool want_first = (i & len) == 0;
                    if (first != want_first) {
                        const unsigned tk = keys[i];
                        keys[i] = keys[o], keys[o] = tk;
                        const int ti = ids[i];
                        ids[i] = ids[o], ids[o] = ti;
                    }
                }
            }
            __syncthreads();
        }
    }
    // Probabilities as the host computes them: top-k renormalises over its candidates (softmax of
    // l/t), top-p alone keeps the whole distribution's.
    const float m_k = row[ids[0]] / t;
    for (int i = threadIdx.x; i < n; i += blockDim.x) probs[i] = k > 0 ? expf(row[ids[i]] / t - m_k) : expf(row[ids[i]] / t - m) / s;
    __syncthreads();
    if (threadIdx.x == 0) {
        if (k > 0) {
            float sk = 0.0f;
            for (int i = 0; i < n; i++) sk += probs[i];
            for (int i = 0; i < n; i++) probs[i] /= sk;
        }
        int keep = n;
        if (top_p < 1.0f) {
            float cum = 0.0f;
            keep = -1;
            for (int i = 0; i < n; i++) {
                cum += probs[i];
                if (cum >= top_p) {
                    keep = i + 1;
                    break;
                }
            }
            // Top-k keeps all its candidates when they fall short; top-p's margin should have
            // covered the host's nucleus, and where it did not the host samples.
            if (keep < 0) keep = k > 0 ? n : -1;
        }
        if (keep < 0) {
            out[r] = -1;
        } else {
            float norm = 1.0f;
            if (top_p < 1.0f) {
                norm = 0.0f;
                for (int i = 0; i < keep; i++) norm += probs[i];
            }
            int pick = ids[keep - 1];
            float cum = 0.0f;
            for (int i = 0; i < keep; i++) {
                cum += top_p < 1.0f ? probs[i] / norm : probs[i];
                if (u < cum) {
                    pick = ids[i];
                    break;
                }
            }
            out[r] = pick;
        }
    }
}
