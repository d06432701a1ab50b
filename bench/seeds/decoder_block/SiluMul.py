# --- developer-written seed (kf's developers, not a model) for the SiluMul region ---
# bench/seeds/decoder_block/SiluMul.py. ``bench/model_gpu.py --seeds`` appends this to the
# text of the task ``kf extract`` wrote for the region (SwiGLU's gate, silu(gate) * up),
# so ``Model`` below is the task's own reference; ``ModelNew`` replaces its forward with
# one CUDA kernel (NVRTC, kf.cuda).
#
# out = silu(gate) * up = gate / (1 + exp(-gate)) * up, in fp32, rounded once to the
# inputs' dtype (to nearest even). Each thread reads ITEMS 16-byte packs of each input
# (8 bf16 or 4 fp32), all in flight before any is used, and writes its packs of the
# output. Inputs whose size or pointers do not allow 16-byte packs take an
# element-by-element kernel. Shapes are read from the tensors; gate and up must have the
# same shape (no broadcasting). bf16 and fp32 on a CUDA device; anything else (another
# dtype, mixed dtypes, shapes that broadcast, the CPU) runs the reference's own forward.
import torch

import kf.cuda

# --- kf:params ---
SPACE = {"BLOCK": [128, 256, 512, 1024], "ITEMS": [1, 2, 4]}
CONFIG = {"BLOCK": 256, "ITEMS": 2}
# --- kf:end ---

SILU_MUL_SOURCE = r"""
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
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float in(float v) { return v; }
    static __device__ __forceinline__ float out(float v) { return v; }
};

__device__ __forceinline__ float silu_mul(float a, float b) {
    return a / (1.0f + expf(-a)) * b;
}

template <typename IO>
__device__ __forceinline__ void silu_mul_packs(const uint4* __restrict__ a,
                                               const uint4* __restrict__ b,
                                               uint4* __restrict__ out, long long packs) {
    typedef typename IO::T T;
    const int E = 16 / (int)sizeof(T);
    union Pack { uint4 v; T e[16 / sizeof(T)]; };
    const long long base = (long long)blockIdx.x * BLOCK * ITEMS + threadIdx.x;
    Pack av[ITEMS], bv[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const long long i = base + (long long)k * BLOCK;
        if (i < packs) { av[k].v = a[i]; bv[k].v = b[i]; }
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const long long i = base + (long long)k * BLOCK;
        if (i < packs) {
            Pack o;
#pragma unroll
            for (int j = 0; j < E; ++j)
                o.e[j] = IO::out(silu_mul(IO::in(av[k].e[j]), IO::in(bv[k].e[j])));
            out[i] = o.v;
        }
    }
}

template <typename IO>
__device__ __forceinline__ void silu_mul_each(const typename IO::T* __restrict__ a,
                                              const typename IO::T* __restrict__ b,
                                              typename IO::T* __restrict__ out, long long n) {
    const long long i = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (i < n) out[i] = IO::out(silu_mul(IO::in(a[i]), IO::in(b[i])));
}

#define SILU_MUL_ENTRIES(NAME, IO)                                                     \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                \
    NAME##_vec(const uint4* __restrict__ a, const uint4* __restrict__ b,                \
               uint4* __restrict__ out, long long packs) {                              \
        silu_mul_packs<IO>(a, b, out, packs);                                           \
    }                                                                                   \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                \
    NAME##_scalar(const IO::T* __restrict__ a, const IO::T* __restrict__ b,             \
                  IO::T* __restrict__ out, long long n) {                               \
        silu_mul_each<IO>(a, b, out, n);                                                \
    }
SILU_MUL_ENTRIES(silu_mul_bf16, Bf16)
SILU_MUL_ENTRIES(silu_mul_f32, F32)
"""

_SILU_KERNELS = {torch.bfloat16: "silu_mul_bf16", torch.float32: "silu_mul_f32"}


def launch_plan(gate, up, out):
    """(kernel, grid, block, arguments) of one call on contiguous, non-empty gate, up and
    out of one shape and dtype: ITEMS 16-byte packs a thread where they fit, else one
    element a thread."""
    n = gate.numel()
    per_pack = 16 // gate.element_size()
    block, items = CONFIG["BLOCK"], CONFIG["ITEMS"]
    if n % per_pack == 0 and all(t.data_ptr() % 16 == 0 for t in (gate, up, out)):
        packs = n // per_pack
        grid = (packs + block * items - 1) // (block * items)
        return _SILU_KERNELS[gate.dtype] + "_vec", grid, block, [gate, up, out, packs]
    grid = (n + block - 1) // block
    return _SILU_KERNELS[gate.dtype] + "_scalar", grid, block, [gate, up, out, n]


class ModelNew(Model):  # noqa: F821  (the task's reference, above this seed)
    """The region's silu(gate) * up as one CUDA kernel per call (see the comment above)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._program = None
        self._modules = {}  # device index -> kf.cuda.Module
        if torch.cuda.is_available():  # compile errors surface when ModelNew is built
            self._program = kf.cuda.compile_cubin(
                SILU_MUL_SOURCE, name="silu_mul.cu", defines=CONFIG
            )

    def _kernel(self, name, device):
        if self._program is None:
            self._program = kf.cuda.compile_cubin(
                SILU_MUL_SOURCE, name="silu_mul.cu", defines=CONFIG
            )
        module = self._modules.get(device.index)
        if module is None:
            module = self._modules[device.index] = kf.cuda.Module(self._program, device.index)
        return module.function(name)

    def forward(self, gate, up):
        if (
            gate.device.type != "cuda"
            or gate.dtype not in _SILU_KERNELS
            or up.dtype != gate.dtype
            or up.device != gate.device
            or up.shape != gate.shape
        ):
            return super().forward(gate, up)  # the reference: every case left out here
        gate = gate.contiguous()
        up = up.contiguous()
        out = torch.empty_like(gate)
        if gate.numel() == 0:
            return out
        name, grid, block, args = launch_plan(gate, up, out)
        with torch.cuda.device(gate.device):
            self._kernel(name, gate.device).launch(grid, block, args)
        return out
