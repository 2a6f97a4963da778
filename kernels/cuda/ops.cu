// Element-wise and row-wise operations of the forward pass: embedding gather, RMSNorm, RoPE (HF half
// layout), SiLU·mul (and GELU, squared ReLU), BitLinear's 8-bit rows, residual add, bias add, f32→f16 conversion, and per-row argmax for greedy sampling.

extern "C" __global__ void embedding(const u8* table, int t, long long row_bytes, const unsigned* ids, float* out, int cols) {
    const u8* row = table + (long long)ids[blockIdx.x] * row_bytes;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(long long)blockIdx.x * cols + c] = deq_rt(row, t, c);
}

// One block per group of g values (a row, or one head of a row for q/k norms).
extern "C" __global__ void rms_norm(const float* x, float* y, const u8* w, int t, int g, float eps) {
    long long base = (long long)blockIdx.x * g;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < g; i += blockDim.x) {
        float v = x[base + i];
        ss += v * v;
    }
    ss = block_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)g + eps);
    for (int i = threadIdx.x; i < g; i += blockDim.x) y[base + i] = deq_rt(w, t, i) * (x[base + i] * r);
}

// Rotates pairs (i, i + hd/2) of every head; angle = pos * inv_freq[i] in f32, cos/sin in f64 as the CPU does.
// af: what cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int rows, int cols, int hd, float af) {
    int half = hd / 2, heads = cols / hd;
    long long total = (long long)rows * heads * half;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)gridDim.x * blockDim.x) {
        int i = (int)(idx % half);
        long long rh = idx / half;
        int head = (int)(rh % heads);
        int row = (int)(rh / heads);
        float a = (float)pos[row] * inv_freq[i];
        float c = (float)cos((double)a) * af, s = (float)sin((double)a) * af;
        float* p = x + (long long)row * cols + (long long)head * hd;
        float x0 = p[i], x1 = p[i + half];
        p[i] = x0 * c - x1 * s;
        p[i + half] = x1 * c + x0 * s;
    }
}

extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = g[i];
        out[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

// GELU (tanh form, as PyTorch's approximate="tanh") of gate, times up: Gemma's GeGLU.
extern "C" __global__ void gelu_tanh_mul(const float* g, const float* u, float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float x = g[i];
        out[i] = 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x))) * u[i];
    }
}

// relu(gate)² times up: BitNet's squared-ReLU gating.
// dst[r, dst_off + j] = src[r, src_off + j] for j < n: a column slice, or one part of a concatenation.
extern "C" __global__ void copy_cols(const float* src, int src_cols, int src_off, float* dst, int dst_cols,
                                     int dst_off, int rows, int n) {
    const long long total = (long long)rows * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / n;
        const int j = (int)(i % n);
        dst[r * dst_cols + dst_off + j] = src[r * src_cols + src_off + j];
    }
}

// gpt-oss's clamped SwiGLU: (clamp(u, ±limit) + 1) · g' · σ(alpha · g'), g' = min(g, limit).
extern "C" __global__ void swiglu_clamp_mul(const float* g, const float* u, float* out, long long n, float alpha, float limit) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float a = fminf(g[i], limit);
        const float b = fminf(fmaxf(u[i], -limit), limit);
        out[i] = (b + 1.0f) * (a / (1.0f + expf(-a * alpha)));
    }
}

extern "C" __global__ void relu2_mul(const float* g, const float* u, float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float r = fmaxf(g[i], 0.0f);
        out[i] = r * r * u[i];
    }
}

// Each row rounded to 8 bits by its absolute maximum and back, as BitLinear quantizes its input
// (host::quant_row_8bit): scale 127/max(max|x|, 1e-5), rint (ties to even), clamp −128..127, ÷ scale.
// One block per row.
extern "C" __global__ void quant_rows_8bit(const float* x, float* y, int cols) {
    const long long base = (long long)blockIdx.x * cols;
    float m = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(x[base + i]));
    m = fmaxf(block_max(m), 1e-5f);
    const float scale = 127.0f / m;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        y[base + i] = fminf(fmaxf(rintf(x[base + i] * scale), -128.0f), 127.0f) / scale;
}

// out[r, j] = x[r, perm[j]]: activations in the input order of a GPTQ act-order weight. One block
// per row.
extern "C" __global__ void permute_cols(const float* x, const int* perm, float* out, int rows, int cols) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* src = x + (long long)r * cols;
        float* dst = out + (long long)r * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[perm[c]];
    }
}

// Rows idx[0..n) of x (cols wide) into out, in that order: one block per output row.
extern "C" __global__ void gather_rows(const float* x, const int* idx, float* out, int n, int cols) {
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const float* src = x + (long long)idx[r] * cols;
        float* dst = out + (long long)r * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
    }
}

// acc[idx[r]] += scale[r] * y[r] for the n rows of y: one block per row of y (an expert's rows are
// distinct tokens, so no two blocks touch the same row of acc).
extern "C" __global__ void add_rows_scaled(float* acc, const float* y, const int* idx, const float* scale, int n, int cols) {
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        float* dst = acc + (long long)idx[r] * cols;
        const float* src = y + (long long)r * cols;
        const float w = scale[r];
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] += src[c] * w;
    }
}

extern "C" __global__ void add(float* x, const float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) x[i] += y[i];
}

extern "C" __global__ void add_bias(float* x, const u8* b, int t, long long n, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += deq_rt(b, t, (int)(i % cols));
}

extern "C" __global__ void to_f16(const float* x, u16* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) out[i] = f2h(x[i]);
}

extern "C" __global__ void to_bf16(const float* x, u16* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) out[i] = f2bf(x[i]);
}

// The index of the largest value of row (the lowest among equal maxima; 0x7fffffff where no value
// compares larger than -3e38, e.g. all NaN); every thread of the block gets it.
__device__ int block_argmax(const float* row, int cols) {
    float best = -3.0e38f;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = row[c];
        if (v > best) { best = v; bi = c; }
    }
    float m = block_max(best);
    int cand = best == m ? bi : 0x7fffffff;
    __shared__ int idx[32];
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) idx[threadIdx.x >> 5] = cand;
    __syncthreads();
    int r = 0x7fffffff;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) r = min(r, idx[w]);
    return r;
}

// One block per row: index of the largest value (the lowest index among equal maxima).
extern "C" __global__ void argmax(const float* x, unsigned* out, int cols) {
    const int r = block_argmax(x + (long long)blockIdx.x * cols, cols);
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)r;
}
