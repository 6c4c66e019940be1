// attn_simt: the plain-FMA forward kernel, f32 arithmetic throughout (the
// f32 path: no tensor-core rounding, the precision of attn-cpu), also
// correct for f16/bf16. One warp owns one query row; the block's warps are
// consecutive rows of one head and share each K/V tile in shared memory.
// Lanes own keys for the scores (one key each per tile) and output columns
// for P V (columns lane, lane + 32, ...).

#define SIMT_WARPS 8
#define SIMT_TILE 32
#define KSTR (DQK_PAD + 1)
#define VSTR (DV_PAD + 1)

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

extern "C" __global__ void __launch_bounds__(SIMT_WARPS * 32)
attn_simt(const Params p) {
    DYNAMIC_SMEM(float, smem);
    float* Ks = smem;                          // [TILE][KSTR]
    float* Vs = Ks + SIMT_TILE * KSTR;         // [TILE][VSTR]
    float* Qs = Vs + SIMT_TILE * VSTR;         // [WARPS][DQK_PAD]

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y;
    const int b = blockIdx.z / p.num_splits;
    const int split = blockIdx.z % p.num_splits;
    const int g = h / (p.hq / p.hkv);
    const int row0 = blockIdx.x * SIMT_WARPS;
    const int i = row0 + warp;
    const SeqMask m = seq_mask(p, b);
    int blo, bhi, lo, hi;
    block_keys(p, m, row0, row0 + SIMT_WARPS, split, &blo, &bhi);
    key_range(p, m, i, &lo, &hi);

    for (int d = lane; d < DQK_PAD; d += 32) {
        float x = 0.0f;
        if (i < p.sq && d < DQK) {
            x = load_elem(p.q, p.q_off + (i64)b * p.q_st[0] + (i64)i * p.q_st[1] +
                                   (i64)h * p.q_st[2] + (i64)d * p.q_st[3]);
        }
        Qs[warp * DQK_PAD + d] = x;
    }

    float acc[DV_PAD / 32];
#pragma unroll
    for (int c = 0; c < DV_PAD / 32; ++c) acc[c] = 0.0f;
    float mrow = NEG_INF, lrow = 0.0f;
#if HAS_SINKS
    if (p.num_splits == 1 && i < m.ql) {
        mrow = p.sinks[h];
        lrow = mrow == NEG_INF ? 0.0f : 1.0f;
    }
#endif

    for (int t0 = blo; t0 < bhi; t0 += SIMT_TILE) {
        __syncthreads();
        for (int e = threadIdx.x; e < SIMT_TILE * DQK_PAD; e += blockDim.x) {
            int r = e / DQK_PAD, d = e % DQK_PAD, j = t0 + r;
            float x = 0.0f;
            if (j < bhi && d < DQK) {
                x = load_elem(p.k, p.k_off + (i64)b * p.k_st[0] + (i64)j * p.k_st[1] +
                                       (i64)g * p.k_st[2] + (i64)d * p.k_st[3]);
            }
            Ks[r * KSTR + d] = x;
        }
        for (int e = threadIdx.x; e < SIMT_TILE * DV_PAD; e += blockDim.x) {
            int r = e / DV_PAD, d = e % DV_PAD, j = t0 + r;
            float x = 0.0f;
            if (j < bhi && d < DV) {
                x = load_elem(p.v, p.v_off + (i64)b * p.v_st[0] + (i64)j * p.v_st[1] +
                                       (i64)g * p.v_st[2] + (i64)d * p.v_st[3]);
            }
            Vs[r * VSTR + d] = x;
        }
        __syncthreads();

        const int j = t0 + lane;
        float dot = 0.0f;
        for (int d = 0; d < DQK; ++d) {
            dot = fmaf(Qs[warp * DQK_PAD + d], Ks[lane * KSTR + d], dot);
        }
        float s = j < bhi ? score(p, m, b, h, i, j, lo, hi, dot) : NEG_INF;
        float mnew = fmaxf(mrow, warp_max(s));
        float mu = mnew == NEG_INF ? 0.0f : mnew;
        float alpha = expf(mrow - mu);
        float pj = expf(s - mu);
        lrow = lrow * alpha + warp_sum(pj);
        mrow = mnew;
#pragma unroll
        for (int c = 0; c < DV_PAD / 32; ++c) acc[c] *= alpha;
        for (int r = 0; r < SIMT_TILE; ++r) {
            float pr = __shfl_sync(0xffffffffu, pj, r);
#pragma unroll
            for (int c = 0; c < DV_PAD / 32; ++c) {
                acc[c] = fmaf(pr, Vs[r * VSTR + lane + 32 * c], acc[c]);
            }
        }
    }

    if (i >= p.sq) return;
    float L, inv;
    row_lse(mrow, lrow, &L, &inv);
    if (p.num_splits == 1) {
#pragma unroll
        for (int c = 0; c < DV_PAD / 32; ++c) {
            int d = lane + 32 * c;
            if (d < DV) {
                store_elem(p.o, p.o_off + (i64)b * p.o_st[0] + (i64)i * p.o_st[1] +
                                    (i64)h * p.o_st[2] + (i64)d * p.o_st[3],
                           acc[c] * inv);
            }
        }
        if (p.lse && lane == 0) p.lse[((i64)b * p.hq + h) * p.sq + i] = L;
    } else {
        i64 row = (((i64)split * p.batch + b) * p.hq + h) * p.sq + i;
#pragma unroll
        for (int c = 0; c < DV_PAD / 32; ++c) {
            int d = lane + 32 * c;
            if (d < DV) p.part_o[row * DV + d] = acc[c] * inv;
        }
        if (lane == 0) p.part_lse[row] = L;
    }
}
