// attn-cuda: what every kernel shares. Compiled by NVRTC with no headers:
// the host prepends the variant's `#define`s (see src/variant.rs), then this
// file, then one kernel file. Element types are raw 16-bit patterns,
// converted with PTX, so no CUDA header is needed at run time.
//
// Defines every variant sets:
//   ELEM        0 f32, 1 f16, 2 bf16 (Q, K, V and O)
//   BIAS_KIND   0 none, 1 f32, 2 f16, 3 bf16
//   HAS_MASK    boolean mask tensor (u8, nonzero = take part)
//   HAS_WINDOW  a causal or sliding window (left/right at run time)
//   HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS
//   DQK, DV     head dims; DQK_PAD, DV_PAD their padded sizes

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define NEG_INF (__int_as_float(0xff800000))

// The block's dynamic shared memory as `T* name` (the CPU emulator,
// ATTN_EMU in src/emu.rs, defines its own).
// A static shared array `T name dims` (dims: `[n]` or `[n][m]`), which
// the emulator places in its poisoned arena.
#ifndef ATTN_EMU
#define DYNAMIC_SMEM(T, name) extern __shared__ __align__(16) T name[]
#define STATIC_SMEM(T, name, dims) __shared__ T name dims
#endif

// The problem, passed by value (layout mirrored by `Params` in
// src/params.rs: keep the two in the same order).
struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;           // [b, hq, sq] f32, or null
    const void* bias;     // or null
    const unsigned char* mask;  // or null
    const int* q_lens;    // [b] or null
    const int* kv_lens;   // [b] or null
    const float* alibi;   // [hq] or null
    const float* sinks;   // [hq] or null
    float* part_o;        // split-KV partial outputs [split][b][hq][sq][DV]
    float* part_lse;      // split-KV partial lse [split][b][hq][sq]
    i64 q_st[4];
    i64 k_st[4];
    i64 v_st[4];
    i64 o_st[4];
    i64 bias_st[4];       // broadcast axes have stride 0
    i64 mask_st[4];
    i64 q_off, k_off, v_off, o_off, bias_off, mask_off;
    int batch, hq, hkv, sq, sk;
    int left, right;      // window; -1 = unbounded
    int top_left;         // 1: offset 0; 0: bottom-right
    int num_splits;       // 1: write O and lse; >1: write partials
    int keys_per_split;
    float scale;
    float softcap;
    int kv_vec;           // 1: K and V rows may be copied 16 bytes at a time
    int pack;             // 1, or the GQA group a block's rows pack (mma.cu)
};

__device__ __forceinline__ float bf16_to_f32(u16 x) {
    return __uint_as_float(((u32)x) << 16);
}

__device__ __forceinline__ float f16_to_f32(u16 x) {
#ifdef ATTN_EMU
    return emu::f16_f32(x);
#else
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(x));
    return f;
#endif
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
#ifdef ATTN_EMU
    return emu::f16_rn(f);
#else
    u16 x;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(x) : "f"(f));
    return x;
#endif
}

// Round to nearest even, NaN kept a NaN (the PTX cvt to bf16 needs sm_80;
// this is exact integer arithmetic on any target).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);
    }
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);
    return (u16)((u + rounding) >> 16);
}

#if ELEM == 0
typedef float elem_t;
__device__ __forceinline__ float load_elem(const void* p, i64 i) {
    return ((const float*)p)[i];
}
__device__ __forceinline__ void store_elem(void* p, i64 i, float x) {
    ((float*)p)[i] = x;
}
#elif ELEM == 1
typedef u16 elem_t;
__device__ __forceinline__ float load_elem(const void* p, i64 i) {
    return f16_to_f32(((const u16*)p)[i]);
}
__device__ __forceinline__ void store_elem(void* p, i64 i, float x) {
    ((u16*)p)[i] = f32_to_f16(x);
}
#else
typedef u16 elem_t;
__device__ __forceinline__ float load_elem(const void* p, i64 i) {
    return bf16_to_f32(((const u16*)p)[i]);
}
__device__ __forceinline__ void store_elem(void* p, i64 i, float x) {
    ((u16*)p)[i] = f32_to_bf16(x);
}
#endif

// Rows row0..row0+rows of one head of a rank-4 tensor into shared memory,
// by the whole block: dst[r * ld + d] for d < pad, from element
// base + (row0 + r) * row_st + d * dim_st (base: the head's row 0), and 0
// for rows at or past `end` and columns at or past `dim`.
__device__ __forceinline__ void load_rows(float* dst, int ld, int rows, int pad, int dim,
                                          const void* src, i64 base, i64 row_st, i64 dim_st,
                                          int row0, int end) {
    for (int e = threadIdx.x; e < rows * pad; e += blockDim.x) {
        int r = e / pad, d = e % pad, j = row0 + r;
        float x = 0.0f;
        if (j < end && d < dim) x = load_elem(src, base + (i64)j * row_st + (i64)d * dim_st);
        dst[r * ld + d] = x;
    }
}

// One row into shared memory, by one warp: dst[d] for d < pad, from
// element at + d * dim_st, 0 past `dim` or when the row is not `valid`.
__device__ __forceinline__ void load_row_warp(float* dst, int pad, int dim, const void* src,
                                              i64 at, i64 dim_st, bool valid) {
    for (int d = (threadIdx.x & 31); d < pad; d += 32) {
        dst[d] = (valid && d < dim) ? load_elem(src, at + (i64)d * dim_st) : 0.0f;
    }
}

__device__ __forceinline__ float load_bias(const void* p, i64 i) {
#if BIAS_KIND == 1
    return ((const float*)p)[i];
#elif BIAS_KIND == 2
    return f16_to_f32(((const u16*)p)[i]);
#elif BIAS_KIND == 3
    return bf16_to_f32(((const u16*)p)[i]);
#else
    return 0.0f;
#endif
}

// One sequence's masking model (docs/SEMANTICS.md §4, attn-spec's
// SeqMask): lengths, diagonal offset, window.
struct SeqMask {
    int ql, kl;
    int off;   // row i's diagonal key is i + off
};

__device__ __forceinline__ SeqMask seq_mask(const Params& p, int b) {
    SeqMask m;
    m.ql = p.q_lens ? p.q_lens[b] : p.sq;
    m.kl = p.kv_lens ? p.kv_lens[b] : p.sk;
    m.off = p.top_left ? 0 : m.kl - m.ql;
    return m;
}

// Visible keys of row i: [lo, hi), empty when lo >= hi.
__device__ __forceinline__ void key_range(const Params& p, const SeqMask& m, int i,
                                          int* lo, int* hi) {
    if (i >= m.ql) {
        *lo = 0;
        *hi = 0;
        return;
    }
    long long c = (long long)i + m.off;
    long long l = 0, h = m.kl;
#if HAS_WINDOW
    if (p.left >= 0) {
        long long x = c - p.left;
        l = x < 0 ? 0 : (x > m.kl ? m.kl : x);
    }
    if (p.right >= 0) {
        long long x = c + p.right + 1;
        h = x < 0 ? 0 : (x > m.kl ? m.kl : x);
    }
#endif
    *lo = (int)l;
    *hi = (int)(h > l ? h : l);
}

// Whether the boolean mask (if any) excludes pair (i, j) of head h.
__device__ __forceinline__ bool masked_out(const Params& p, int b, int h, int i, int j) {
#if HAS_MASK
    return p.mask[p.mask_off + (i64)b * p.mask_st[0] + (i64)h * p.mask_st[1] +
                  (i64)i * p.mask_st[2] + (i64)j * p.mask_st[3]] == 0;
#else
    return false;
#endif
}

// Steps 1-5 of the formula for one pair whose raw dot product is `dot`;
// `lo`/`hi` is row i's visible key range. Returns -inf for an excluded pair.
__device__ __forceinline__ float score(const Params& p, const SeqMask& m, int b, int h,
                                       int i, int j, int lo, int hi, float dot) {
    if (j < lo || j >= hi) {
        return NEG_INF;
    }
    float s = dot * p.scale;
#if HAS_SOFTCAP
    s = p.softcap * tanhf(s / p.softcap);
#endif
#if HAS_ALIBI
    {
        long long c = (long long)i + m.off;
        long long d = (long long)j - c;
        s -= p.alibi[h] * (float)(d < 0 ? -d : d);
    }
#endif
#if BIAS_KIND != 0
    s += load_bias(p.bias, p.bias_off + (i64)b * p.bias_st[0] + (i64)h * p.bias_st[1] +
                               (i64)i * p.bias_st[2] + (i64)j * p.bias_st[3]);
#endif
    if (masked_out(p, b, h, i, j)) {
        return NEG_INF;
    }
    return s;
}

// The keys a block of rows [row0, row1) visits in split `split`: the union
// of its rows' ranges (ends are monotone in the row), cut to the split.
__device__ __forceinline__ void block_keys(const Params& p, const SeqMask& m, int row0,
                                           int row1, int split, int* lo, int* hi) {
    int last = (row1 < m.ql ? row1 : m.ql) - 1;
    if (row0 > last) {
        *lo = 0;
        *hi = 0;
        return;
    }
    int l0, h0, l1, h1;
    key_range(p, m, row0, &l0, &h0);
    key_range(p, m, last, &l1, &h1);
    int l = l0, h = h1;
    if (p.num_splits > 1) {
        int s0 = split * p.keys_per_split;
        int s1 = s0 + p.keys_per_split;
        l = l > s0 ? l : s0;
        h = h < s1 ? h : s1;
    }
    *lo = l;
    *hi = h > l ? h : l;
}

// The end of a row: the normaliser and the log-sum-exp from the row's
// running max `m` and sum `l` (l includes the sink when there is one and
// this is the only split). Emptiness is decided by `l` alone: l == 0 exactly
// when nothing took part (a finite max always contributes exp(0) = 1), and
// a NaN that reached the scores (the max, by fmaxf, skips it; the sum does
// not) leaves l NaN, so output and log-sum-exp come out NaN as §6 asks.
__device__ __forceinline__ void row_lse(float m, float l, float* out_lse, float* inv) {
    if (l == 0.0f) {
        *inv = 0.0f;
        *out_lse = NEG_INF;
    } else {
        *inv = 1.0f / l;
        *out_lse = m + logf(l);
    }
}

// max(a, b) that returns NaN when either is NaN (fmaxf returns the other).
__device__ __forceinline__ float nan_max(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}
