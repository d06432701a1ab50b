# --- developer-written seed (kf's developers, not a model) for the RMSNorm region ---
# bench/seeds/decoder_block/RMSNorm.py. ``bench/model_gpu.py --seeds`` appends this to the
# text of the task ``kf extract`` wrote for the region, so ``Model`` below is the task's own
# reference: ``ModelNew`` inherits its constructor (the same parameters, drawn the same
# way) and replaces its forward with one CUDA kernel (NVRTC, kf.cuda).
#
# What it computes, as examples/models/decoder_block.py's RMSNorm does: h = x in fp32;
# h = h * rsqrt(mean(h^2, -1) + eps); out = (h * weight in fp32) in x's dtype, rounded
# once, to nearest even. One block per row: the row's 16-byte packs are read once into
# registers (ITEMS per thread; a longer row reads the rest again), the sum of squares is
# accumulated in fp32 and reduced across the block (warp shuffles, then one warp), and the
# packs are scaled and stored. A row whose length or pointers do not allow 16-byte packs
# takes the same kernel's element-by-element path. Shapes are read from the tensors.
# bf16 x and weight on a CUDA device only: the task's graph ends in a cast to bf16 (the
# model's dtype when kf extract traced it), so that is the one dtype it is verified at;
# anything else (another dtype, mixed dtypes, the CPU) runs the reference's own forward.
import torch

import kf.cuda

# --- kf:params ---
SPACE = {"BLOCK": [128, 256, 512, 1024], "ITEMS": [1, 2, 4]}
CONFIG = {"BLOCK": 128, "ITEMS": 4}
# --- kf:end ---

#: eps of the example's RMSNorm (the task's graph adds 1e-06 to the mean of squares)
RMS_EPS = 1e-6

RMSNORM_SOURCE = r"""
// bf16 travels as its 16 bits (unsigned short): no cuda_bf16.h, so NVRTC and nvcc
// compile the same text with no include at all.
struct Bf16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float in(unsigned short b) {
        return __uint_as_float(((unsigned int)b) << 16);
    }
    static __device__ __forceinline__ unsigned short out(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;  // NaN
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as c10::BFloat16
        return (unsigned short)(u >> 16);
    }
};
// The sum of v over the block (blockDim.x a multiple of 32, at most 1024), known to all.
__device__ __forceinline__ float block_sum(float v, float* partial) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) partial[32] = v;
    }
    __syncthreads();
    return partial[32];
}

template <typename IO, bool VEC>
__device__ __forceinline__ void rmsnorm_row(const typename IO::T* __restrict__ x,
                                            const typename IO::T* __restrict__ w,
                                            typename IO::T* __restrict__ out,
                                            long long cols, float eps) {
    typedef typename IO::T T;
    const int E = 16 / (int)sizeof(T);  // elements in a 16-byte pack
    union Pack { uint4 v; T e[16 / sizeof(T)]; };
    __shared__ float partial[33];
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    T* orow = out + row * cols;
    float ss = 0.0f;
    if (VEC) {
        const long long packs = cols / E;
        const uint4* xp = reinterpret_cast<const uint4*>(xr);
        const uint4* wp = reinterpret_cast<const uint4*>(w);
        uint4* op = reinterpret_cast<uint4*>(orow);
        Pack kept[ITEMS];
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            const long long i = threadIdx.x + (long long)k * BLOCK;
            if (i < packs) {
                kept[k].v = xp[i];
#pragma unroll
                for (int j = 0; j < E; ++j) { const float f = IO::in(kept[k].e[j]); ss += f * f; }
            }
        }
        for (long long i = threadIdx.x + (long long)ITEMS * BLOCK; i < packs; i += BLOCK) {
            Pack p;
            p.v = xp[i];
#pragma unroll
            for (int j = 0; j < E; ++j) { const float f = IO::in(p.e[j]); ss += f * f; }
        }
        const float inv = rsqrtf(block_sum(ss, partial) / (float)cols + eps);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            const long long i = threadIdx.x + (long long)k * BLOCK;
            if (i < packs) {
                Pack wv, o;
                wv.v = wp[i];
#pragma unroll
                for (int j = 0; j < E; ++j)
                    o.e[j] = IO::out(IO::in(kept[k].e[j]) * inv * IO::in(wv.e[j]));
                op[i] = o.v;
            }
        }
        for (long long i = threadIdx.x + (long long)ITEMS * BLOCK; i < packs; i += BLOCK) {
            Pack p, wv, o;
            p.v = xp[i];
            wv.v = wp[i];
#pragma unroll
            for (int j = 0; j < E; ++j) o.e[j] = IO::out(IO::in(p.e[j]) * inv * IO::in(wv.e[j]));
            op[i] = o.v;
        }
    } else {
        for (long long i = threadIdx.x; i < cols; i += BLOCK) {
            const float f = IO::in(xr[i]);
            ss += f * f;
        }
        const float inv = rsqrtf(block_sum(ss, partial) / (float)cols + eps);
        for (long long i = threadIdx.x; i < cols; i += BLOCK)
            orow[i] = IO::out(IO::in(xr[i]) * inv * IO::in(w[i]));
    }
}

#define RMSNORM_ENTRY(NAME, IO, VEC)                                                    \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                 \
    NAME(const IO::T* __restrict__ x, const IO::T* __restrict__ w,                       \
         IO::T* __restrict__ out, long long cols, float eps) {                           \
        rmsnorm_row<IO, VEC>(x, w, out, cols, eps);                                      \
    }
RMSNORM_ENTRY(rmsnorm_bf16_vec, Bf16, true)
RMSNORM_ENTRY(rmsnorm_bf16_scalar, Bf16, false)
"""

_RMS_KERNELS = {torch.bfloat16: "rmsnorm_bf16"}


def launch_plan(x, w, out):
    """(kernel, grid, block, arguments) of one call on contiguous x, w and out of x's
    dtype, x with at least one row: a block per row, 16-byte packs where they fit."""
    cols = x.shape[-1]
    vec = (cols * x.element_size()) % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, w, out))
    name = _RMS_KERNELS[x.dtype] + ("_vec" if vec else "_scalar")
    return name, x.numel() // cols, CONFIG["BLOCK"], [x, w, out, cols, float(RMS_EPS)]


class ModelNew(Model):  # noqa: F821  (the task's reference, above this seed)
    """The region's RMSNorm as one CUDA kernel per call (see the comment above)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._program = None
        self._modules = {}  # device index -> kf.cuda.Module
        if torch.cuda.is_available():  # compile errors surface when ModelNew is built
            self._program = kf.cuda.compile_cubin(RMSNORM_SOURCE, name="rmsnorm.cu", defines=CONFIG)

    def _kernel(self, name, device):
        if self._program is None:
            self._program = kf.cuda.compile_cubin(RMSNORM_SOURCE, name="rmsnorm.cu", defines=CONFIG)
        module = self._modules.get(device.index)
        if module is None:
            module = self._modules[device.index] = kf.cuda.Module(self._program, device.index)
        return module.function(name)

    def forward(self, x):
        w = self.weight
        if (
            x.device.type != "cuda"
            or x.dtype not in _RMS_KERNELS
            or w.dtype != x.dtype
            or w.device != x.device
            or w.dim() != 1
            or x.dim() == 0
            or x.shape[-1] != w.shape[0]
        ):
            return super().forward(x)  # the reference: every case this kernel leaves out
        x = x.contiguous()
        w = w.detach().contiguous()
        out = torch.empty_like(x)
        if x.numel() == 0:
            return out
        name, grid, block, args = launch_plan(x, w, out)
        with torch.cuda.device(x.device):
            self._kernel(name, x.device).launch(grid, block, args)
        return out
