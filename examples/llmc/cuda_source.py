"""CUDA C source of the llm.c-style kernels, compiled at run time by NVRTC (see kernels.py).

Conventions shared by every kernel:
- fp32 data, contiguous row-major buffers; integer targets are int32.
- Sizes that can exceed 2**31 (element and row counts) are `long long`; per-dimension sizes are `int`.
- Elementwise and layout kernels use grid-stride loops, so any grid size covers the work.
- Every output element is written exactly once (no read-modify-write), so outputs may be allocated uninitialised.
- No headers are included: NVRTC provides the math builtins, and the build stays independent of a CUDA toolkit.
"""

CUDA_SOURCE = r"""
#define LLMC_INF __int_as_float(0x7f800000)
#define LLMC_NAN __int_as_float(0x7fffffff)
#define LLMC_GELU_K 0.7978845608028654f   /* sqrt(2 / pi) */
#define LLMC_GELU_C 0.044715f

#define GRID_STRIDE_LOOP(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct SumOp { __device__ float operator()(float a, float b) const { return a + b; } };

template <typename Op>
__device__ float warp_reduce(float v, Op op) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// Every thread of the block gets the reduction of `v` over the block. blockDim.x must be a multiple of 32;
// `scratch` holds 33 floats (one per warp plus the broadcast slot).
template <typename Op>
__device__ float block_reduce(float v, float identity, float* scratch, Op op) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();  // a previous call's readers of scratch are done before it is overwritten
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = warp_reduce(lane < n_warps ? scratch[lane] : identity, op);
        if (lane == 0) scratch[32] = v;
    }
    __syncthreads();
    return scratch[32];
}

// ---- attention layout ------------------------------------------------------------------------------------
// Element i of a (B, NH, N, d) tensor of heads, found in a token-major tensor whose rows (b, n) hold `row` heads of
// d values each: the fused projection qkv (B, N, 3, NH, d) with row = 3 * NH (its q part; k and v follow at
// NH * d and 2 * NH * d), or the merged heads (B, N, NH, d) with row = NH. One thread per element of the heads.
__device__ __forceinline__ long long token_major_offset(long long i, int N, int NH, int d, int row) {
    const int e = (int)(i % d);
    long long rest = i / d;
    const int n = (int)(rest % N);
    rest /= N;
    const int h = (int)(rest % NH);
    const long long b = rest / NH;
    return ((b * N + n) * row + h) * (long long)d + e;
}

extern "C" __global__ void llmc_permute_split(float* __restrict__ q, float* __restrict__ k, float* __restrict__ v,
                                              const float* __restrict__ qkv, int B, int N, int NH, int d) {
    const long long total = (long long)B * NH * N * d;
    const long long part = (long long)NH * d;  // distance between the q, k and v entries of one (b, n)
    GRID_STRIDE_LOOP(i, total) {
        const long long src = token_major_offset(i, N, NH, d, 3 * NH);
        q[i] = qkv[src];
        k[i] = qkv[src + part];
        v[i] = qkv[src + 2 * part];
    }
}

extern "C" __global__ void llmc_permute_split_backward(float* __restrict__ dqkv, const float* __restrict__ dq,
                                                       const float* __restrict__ dk, const float* __restrict__ dv,
                                                       int B, int N, int NH, int d) {
    const long long total = (long long)B * NH * N * d;
    const long long part = (long long)NH * d;
    GRID_STRIDE_LOOP(i, total) {
        const long long dst = token_major_offset(i, N, NH, d, 3 * NH);
        dqkv[dst] = dq[i];
        dqkv[dst + part] = dk[i];
        dqkv[dst + 2 * part] = dv[i];
    }
}

// heads: (B, NH, N, d); merged: (B, N, NH, d). One thread per element of heads.

extern "C" __global__ void llmc_unpermute(float* __restrict__ merged, const float* __restrict__ heads,
                                          int B, int N, int NH, int d) {
    const long long total = (long long)B * NH * N * d;
    GRID_STRIDE_LOOP(i, total) {
        merged[token_major_offset(i, N, NH, d, NH)] = heads[i];
    }
}

extern "C" __global__ void llmc_unpermute_backward(float* __restrict__ dheads, const float* __restrict__ dmerged,
                                                   int B, int N, int NH, int d) {
    const long long total = (long long)B * NH * N * d;
    GRID_STRIDE_LOOP(i, total) {
        dheads[i] = dmerged[token_major_offset(i, N, NH, d, NH)];
    }
}

// ---- softmax over the last dim ---------------------------------------------------------------------------
// One block per row. The row maximum is subtracted before exponentiating, so large logits do not overflow;
// masked (-inf) entries become exact zeros.

extern "C" __global__ void llmc_softmax(float* __restrict__ out, const float* __restrict__ inp,
                                        long long rows, int C) {
    __shared__ float scratch[33];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x = inp + row * C;
        float* y = out + row * C;
        float m = -LLMC_INF;
        for (int c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, x[c]);
        m = block_reduce(m, -LLMC_INF, scratch, MaxOp());
        float s = 0.0f;
        for (int c = threadIdx.x; c < C; c += blockDim.x) s += expf(x[c] - m);
        s = block_reduce(s, 0.0f, scratch, SumOp());
        for (int c = threadIdx.x; c < C; c += blockDim.x) y[c] = expf(x[c] - m) / s;
    }
}

// ---- cross-entropy ---------------------------------------------------------------------------------------
// A negative target marks an ignored position: its loss and its logits' gradient are 0. A target >= V is out
// of range (torch raises); it yields NaN so that it cannot pass unnoticed.

extern "C" __global__ void llmc_crossentropy_forward(float* __restrict__ losses, const float* __restrict__ probs,
                                                     const int* __restrict__ targets, long long rows, int V) {
    GRID_STRIDE_LOOP(r, rows) {
        const int t = targets[r];
        float loss;
        if (t < 0) {
            loss = 0.0f;
        } else if (t >= V) {
            loss = LLMC_NAN;
        } else {
            loss = -logf(probs[r * V + t]);
        }
        losses[r] = loss;
    }
}

// d loss_r / d logits_{r,c} = (probs_{r,c} - [c == t_r]) * dlosses_r: softmax and cross-entropy fused.
extern "C" __global__ void llmc_crossentropy_softmax_backward(float* __restrict__ dlogits,
                                                              const float* __restrict__ dlosses,
                                                              const float* __restrict__ probs,
                                                              const int* __restrict__ targets,
                                                              long long rows, int V) {
    GRID_STRIDE_LOOP(i, rows * V) {
        const long long r = i / V;
        const int c = (int)(i - r * V);
        const int t = targets[r];
        float g;
        if (t < 0) {
            g = 0.0f;
        } else if (t >= V) {
            g = LLMC_NAN;
        } else {
            g = (probs[i] - (c == t ? 1.0f : 0.0f)) * dlosses[r];
        }
        dlogits[i] = g;
    }
}

// ---- tanh GELU -------------------------------------------------------------------------------------------

extern "C" __global__ void llmc_gelu_forward(float* __restrict__ out, const float* __restrict__ inp,
                                             long long n) {
    GRID_STRIDE_LOOP(i, n) {
        const float x = inp[i];
        const float u = LLMC_GELU_K * (x + LLMC_GELU_C * x * x * x);
        out[i] = 0.5f * x * (1.0f + tanhf(u));
    }
}

extern "C" __global__ void llmc_gelu_backward(float* __restrict__ dinp, const float* __restrict__ inp,
                                              const float* __restrict__ dout, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        const float x = inp[i];
        const float u = LLMC_GELU_K * (x + LLMC_GELU_C * x * x * x);
        const float th = tanhf(u);
        const float du_dx = LLMC_GELU_K * (1.0f + 3.0f * LLMC_GELU_C * x * x);
        const float local = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du_dx;
        dinp[i] = local * dout[i];
    }
}

// ---- LayerNorm over the last dim -------------------------------------------------------------------------
// One warp per row; the variance is the biased one (sum of squared deviations / C), as in torch.

extern "C" __global__ void llmc_layernorm_forward(float* __restrict__ out, float* __restrict__ mean,
                                                  float* __restrict__ rstd, const float* __restrict__ inp,
                                                  const float* __restrict__ weight, const float* __restrict__ bias,
                                                  long long rows, int C, float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // uniform per warp, so the shuffles below see full warps
    const float* x = inp + row * C;
    float s = 0.0f;
    for (int c = lane; c < C; c += 32) s += x[c];
    const float m = warp_reduce(s, SumOp()) / C;
    float ss = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float dev = x[c] - m;
        ss += dev * dev;
    }
    const float r = rsqrtf(warp_reduce(ss, SumOp()) / C + eps);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
    float* y = out + row * C;
    for (int c = lane; c < C; c += 32) y[c] = (x[c] - m) * r * weight[c] + bias[c];
}

// dx = rstd * (dn - mean(dn) - xhat * mean(dn * xhat)) with dn = weight * dout, one warp per row.
extern "C" __global__ void llmc_layernorm_backward_input(float* __restrict__ dinp, const float* __restrict__ dout,
                                                         const float* __restrict__ inp,
                                                         const float* __restrict__ weight,
                                                         const float* __restrict__ mean,
                                                         const float* __restrict__ rstd, long long rows, int C) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float* x = inp + row * C;
    const float* g = dout + row * C;
    const float m = mean[row];
    const float r = rstd[row];
    float dn_sum = 0.0f;
    float dn_xhat_sum = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float dn = weight[c] * g[c];
        dn_sum += dn;
        dn_xhat_sum += dn * (x[c] - m) * r;
    }
    const float dn_mean = warp_reduce(dn_sum, SumOp()) / C;
    const float dn_xhat_mean = warp_reduce(dn_xhat_sum, SumOp()) / C;
    float* dx = dinp + row * C;
    for (int c = lane; c < C; c += 32) {
        const float xhat = (x[c] - m) * r;
        dx[c] = r * (weight[c] * g[c] - dn_mean - xhat * dn_xhat_mean);
    }
}

// dweight_c = sum_r dout_{r,c} * xhat_{r,c}, dbias_c = sum_r dout_{r,c}. A block of (32, LN_ROW_LANES) threads
// owns 32 columns: threadIdx.x walks the columns (coalesced), threadIdx.y strides the rows, and the partial
// sums are combined in shared memory in a fixed order, so the result is deterministic (no atomics).
#define LN_ROW_LANES 32
extern "C" __global__ void llmc_layernorm_backward_params(float* __restrict__ dweight, float* __restrict__ dbias,
                                                          const float* __restrict__ dout,
                                                          const float* __restrict__ inp,
                                                          const float* __restrict__ mean,
                                                          const float* __restrict__ rstd, long long rows, int C) {
    __shared__ float dw_part[LN_ROW_LANES][33];
    __shared__ float db_part[LN_ROW_LANES][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float dw = 0.0f;
    float db = 0.0f;
    if (c < C) {
        for (long long r = threadIdx.y; r < rows; r += LN_ROW_LANES) {
            const float g = dout[r * C + c];
            db += g;
            dw += g * (inp[r * C + c] - mean[r]) * rstd[r];
        }
    }
    dw_part[threadIdx.y][threadIdx.x] = dw;
    db_part[threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float dw_total = 0.0f;
        float db_total = 0.0f;
        for (int j = 0; j < LN_ROW_LANES; ++j) {
            dw_total += dw_part[j][threadIdx.x];
            db_total += db_part[j][threadIdx.x];
        }
        dweight[c] = dw_total;
        dbias[c] = db_total;
    }
}
"""

KERNEL_NAMES = (
    "llmc_permute_split",
    "llmc_permute_split_backward",
    "llmc_unpermute",
    "llmc_unpermute_backward",
    "llmc_softmax",
    "llmc_crossentropy_forward",
    "llmc_crossentropy_softmax_backward",
    "llmc_gelu_forward",
    "llmc_gelu_backward",
    "llmc_layernorm_forward",
    "llmc_layernorm_backward_input",
    "llmc_layernorm_backward_params",
)

# The block shape llmc_layernorm_backward_params is written for.
LAYERNORM_PARAMS_BLOCK = (32, 32)
