// The backward pass (docs/SEMANTICS.md §7b), f32 arithmetic throughout,
// any element type; deterministic (no atomics: every gradient element has
// one writer, and every sum runs in a fixed order). Three kernels, launched
// in this order on one stream:
//
//   attn_bwd_dq     one warp per query row (8 rows of one head per block):
//                   D = dO . O, then over the row's keys (tiles of 32 in
//                   shared memory, a key per lane) P = exp(s - lse),
//                   dS = P (dP - D), dq += dS g k; writes dq, D and the
//                   bias gradient (per-(batch, head) bias only).
//   attn_bwd_dkdv   one warp per key (8 keys of one K/V head per block):
//                   over the query heads of its group and the rows that see
//                   it (tiles of 32, a row per lane) the same P and dS,
//                   dk += dS g q, dv += P dO; writes dk and dv.
//   attn_bwd_dsinks one block per query head: dsink = -sum exp(sink - lse) D,
//                   a fixed-order tree over (batch, row).

#define BWD_WARPS 8
#define BWD_TILE 32
#define KSTR (DQK_PAD + 1)
#define VSTR (DV_PAD + 1)

struct BwdParams {
    Params p;             // the forward's problem; p.o is the forward output O
    const void* d_out;    // dO, laid out as O (p.o_st, p.o_off)
    void* dq;             // laid out as Q
    void* dk;             // laid out as K
    void* dv;             // laid out as V
    float* d_rows;        // D = dO . O, [b, hq, sq] f32 (written by attn_bwd_dq)
    float* dbias;         // or null; strides dbias_st
    float* dsinks;        // [hq] or null
    i64 dbias_st[4];
};

__device__ __forceinline__ float bwd_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// d score / d (q . k) of a pair whose raw dot product is `dot`.
__device__ __forceinline__ float score_slope(const Params& p, float dot) {
#if HAS_SOFTCAP
    float t = tanhf(dot * p.scale / p.softcap);
    return p.scale * (1.0f - t * t);
#else
    return p.scale;
#endif
}

// P of a pair: exp(s - lse), 0 for an excluded pair or a row that sees
// nothing (lse = -inf).
__device__ __forceinline__ float pair_prob(float s, float lse) {
    return (s == NEG_INF || lse == NEG_INF) ? 0.0f : expf(s - lse);
}

extern "C" __global__ void __launch_bounds__(BWD_WARPS * 32)
attn_bwd_dq(const BwdParams bp) {
    const Params& p = bp.p;
    DYNAMIC_SMEM(float, smem);
    float* Ks = smem;                          // [TILE][KSTR]
    float* Vs = Ks + BWD_TILE * KSTR;          // [TILE][VSTR]
    float* Qs = Vs + BWD_TILE * VSTR;          // [WARPS][DQK_PAD]
    float* Gs = Qs + BWD_WARPS * DQK_PAD;      // [WARPS][DV_PAD]: dO rows

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, b = blockIdx.z;
    const int g = h / (p.hq / p.hkv);
    const int row0 = blockIdx.x * BWD_WARPS;
    const int i = row0 + warp;
    const SeqMask m = seq_mask(p, b);
    int blo, bhi, lo, hi;
    block_keys(p, m, row0, row0 + BWD_WARPS, 0, &blo, &bhi);
    key_range(p, m, i, &lo, &hi);

    float dsum = 0.0f;
    load_row_warp(Qs + warp * DQK_PAD, DQK_PAD, DQK, p.q,
                  p.q_off + (i64)b * p.q_st[0] + (i64)i * p.q_st[1] + (i64)h * p.q_st[2],
                  p.q_st[3], i < p.sq);
    for (int d = lane; d < DV_PAD; d += 32) {
        float x = 0.0f;
        if (i < p.sq && d < DV) {
            i64 at = p.o_off + (i64)b * p.o_st[0] + (i64)i * p.o_st[1] + (i64)h * p.o_st[2] +
                     (i64)d * p.o_st[3];
            x = load_elem(bp.d_out, at);
            dsum = fmaf(x, load_elem(p.o, at), dsum);
        }
        Gs[warp * DV_PAD + d] = x;
    }
    const float D = bwd_warp_sum(dsum);
    const i64 row = ((i64)b * p.hq + h) * p.sq + i;
    const float L = (i < m.ql) ? p.lse[row] : NEG_INF;
    if (i < p.sq && lane == 0) bp.d_rows[row] = D;

    float acc[DQK_PAD / 32];
#pragma unroll
    for (int c = 0; c < DQK_PAD / 32; ++c) acc[c] = 0.0f;

    for (int t0 = blo; t0 < bhi; t0 += BWD_TILE) {
        __syncthreads();
        load_rows(Ks, KSTR, BWD_TILE, DQK_PAD, DQK, p.k,
                  p.k_off + (i64)b * p.k_st[0] + (i64)g * p.k_st[2], p.k_st[1], p.k_st[3], t0, bhi);
        load_rows(Vs, VSTR, BWD_TILE, DV_PAD, DV, p.v,
                  p.v_off + (i64)b * p.v_st[0] + (i64)g * p.v_st[2], p.v_st[1], p.v_st[3], t0, bhi);
        __syncthreads();

        const int j = t0 + lane;
        float dot = 0.0f, dp = 0.0f;
        for (int d = 0; d < DQK; ++d) dot = fmaf(Qs[warp * DQK_PAD + d], Ks[lane * KSTR + d], dot);
        for (int d = 0; d < DV; ++d) dp = fmaf(Gs[warp * DV_PAD + d], Vs[lane * VSTR + d], dp);
        const float s = j < bhi ? score(p, m, b, h, i, j, lo, hi, dot) : NEG_INF;
        const float pj = pair_prob(s, L);
        const float ds = pj * (dp - D);
        const float dsc = pj == 0.0f ? 0.0f : ds * score_slope(p, dot);
        if (bp.dbias && s != NEG_INF && L != NEG_INF) {
            bp.dbias[(i64)b * bp.dbias_st[0] + (i64)h * bp.dbias_st[1] +
                     (i64)i * bp.dbias_st[2] + (i64)j * bp.dbias_st[3]] = ds;
        }
        for (int r = 0; r < BWD_TILE; ++r) {
            const float cr = __shfl_sync(0xffffffffu, dsc, r);
#pragma unroll
            for (int c = 0; c < DQK_PAD / 32; ++c) {
                acc[c] = fmaf(cr, Ks[r * KSTR + lane + 32 * c], acc[c]);
            }
        }
    }

    if (i >= p.sq) return;
#pragma unroll
    for (int c = 0; c < DQK_PAD / 32; ++c) {
        int d = lane + 32 * c;
        if (d < DQK) {
            store_elem(bp.dq, p.q_off + (i64)b * p.q_st[0] + (i64)i * p.q_st[1] +
                                  (i64)h * p.q_st[2] + (i64)d * p.q_st[3],
                       acc[c]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(BWD_WARPS * 32)
attn_bwd_dkdv(const BwdParams bp) {
    const Params& p = bp.p;
    DYNAMIC_SMEM(float, smem);
    float* Qs = smem;                          // [TILE][KSTR]: query rows
    float* Gs = Qs + BWD_TILE * KSTR;          // [TILE][VSTR]: dO rows
    float* Kw = Gs + BWD_TILE * VSTR;          // [WARPS][DQK_PAD]: this block's keys
    float* Vw = Kw + BWD_WARPS * DQK_PAD;      // [WARPS][DV_PAD]
    float* Ls = Vw + BWD_WARPS * DV_PAD;       // [TILE] lse
    float* Ds = Ls + BWD_TILE;                 // [TILE] D

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = blockIdx.y, b = blockIdx.z;
    const int group = p.hq / p.hkv;
    const int key0 = blockIdx.x * BWD_WARPS;
    const int key1 = key0 + BWD_WARPS;
    const int j = key0 + warp;
    const SeqMask m = seq_mask(p, b);

    load_row_warp(Kw + warp * DQK_PAD, DQK_PAD, DQK, p.k,
                  p.k_off + (i64)b * p.k_st[0] + (i64)j * p.k_st[1] + (i64)g * p.k_st[2],
                  p.k_st[3], j < p.sk);
    load_row_warp(Vw + warp * DV_PAD, DV_PAD, DV, p.v,
                  p.v_off + (i64)b * p.v_st[0] + (i64)j * p.v_st[1] + (i64)g * p.v_st[2],
                  p.v_st[3], j < p.sk);

    float dk[DQK_PAD / 32], dv[DV_PAD / 32];
#pragma unroll
    for (int c = 0; c < DQK_PAD / 32; ++c) dk[c] = 0.0f;
#pragma unroll
    for (int c = 0; c < DV_PAD / 32; ++c) dv[c] = 0.0f;

    for (int hh = 0; hh < group; ++hh) {
        const int h = g * group + hh;
        for (int r0 = 0; r0 < m.ql; r0 += BWD_TILE) {
            // Visible ranges are monotone in the row: the tile sees one of
            // this block's keys iff its first row starts before their end
            // and its last row ends after their start (uniform per block).
            int rl = (r0 + BWD_TILE < m.ql ? r0 + BWD_TILE : m.ql) - 1;
            int lo0, hi0, lo1, hi1;
            key_range(p, m, r0, &lo0, &hi0);
            key_range(p, m, rl, &lo1, &hi1);
            if (!(lo0 < key1 && hi1 > key0 && lo0 < p.sk)) continue;
            __syncthreads();
            load_rows(Qs, KSTR, BWD_TILE, DQK_PAD, DQK, p.q,
                      p.q_off + (i64)b * p.q_st[0] + (i64)h * p.q_st[2], p.q_st[1], p.q_st[3], r0, m.ql);
            load_rows(Gs, VSTR, BWD_TILE, DV_PAD, DV, bp.d_out,
                      p.o_off + (i64)b * p.o_st[0] + (i64)h * p.o_st[2], p.o_st[1], p.o_st[3], r0, m.ql);
            for (int r = threadIdx.x; r < BWD_TILE; r += blockDim.x) {
                int i = r0 + r;
                i64 row = ((i64)b * p.hq + h) * p.sq + i;
                Ls[r] = i < m.ql ? p.lse[row] : NEG_INF;
                Ds[r] = i < m.ql ? bp.d_rows[row] : 0.0f;
            }
            __syncthreads();

            const int i = r0 + lane;
            int lo, hi;
            key_range(p, m, i, &lo, &hi);
            float dot = 0.0f, dp = 0.0f;
            for (int d = 0; d < DQK; ++d) dot = fmaf(Qs[lane * KSTR + d], Kw[warp * DQK_PAD + d], dot);
            for (int d = 0; d < DV; ++d) dp = fmaf(Gs[lane * VSTR + d], Vw[warp * DV_PAD + d], dp);
            const float s = (i < m.ql && j < p.sk) ? score(p, m, b, h, i, j, lo, hi, dot) : NEG_INF;
            const float pj = pair_prob(s, Ls[lane]);
            const float dsc = pj == 0.0f ? 0.0f : pj * (dp - Ds[lane]) * score_slope(p, dot);
            for (int r = 0; r < BWD_TILE; ++r) {
                const float pr = __shfl_sync(0xffffffffu, pj, r);
                const float cr = __shfl_sync(0xffffffffu, dsc, r);
#pragma unroll
                for (int c = 0; c < DQK_PAD / 32; ++c) {
                    dk[c] = fmaf(cr, Qs[r * KSTR + lane + 32 * c], dk[c]);
                }
#pragma unroll
                for (int c = 0; c < DV_PAD / 32; ++c) {
                    dv[c] = fmaf(pr, Gs[r * VSTR + lane + 32 * c], dv[c]);
                }
            }
        }
    }

    if (j >= p.sk) return;
#pragma unroll
    for (int c = 0; c < DQK_PAD / 32; ++c) {
        int d = lane + 32 * c;
        if (d < DQK) {
            store_elem(bp.dk, p.k_off + (i64)b * p.k_st[0] + (i64)j * p.k_st[1] +
                                  (i64)g * p.k_st[2] + (i64)d * p.k_st[3],
                       dk[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < DV_PAD / 32; ++c) {
        int d = lane + 32 * c;
        if (d < DV) {
            store_elem(bp.dv, p.v_off + (i64)b * p.v_st[0] + (i64)j * p.v_st[1] +
                                  (i64)g * p.v_st[2] + (i64)d * p.v_st[3],
                       dv[c]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
attn_bwd_dsinks(const BwdParams bp) {
    const Params& p = bp.p;
    STATIC_SMEM(float, part, [256]);
    const int h = blockIdx.x;
    float acc = 0.0f;
#if HAS_SINKS
    const float sink = p.sinks[h];
    for (i64 e = threadIdx.x; e < (i64)p.batch * p.sq; e += blockDim.x) {
        int b = (int)(e / p.sq), i = (int)(e % p.sq);
        SeqMask m = seq_mask(p, b);
        i64 row = ((i64)b * p.hq + h) * p.sq + i;
        float L = i < m.ql ? p.lse[row] : NEG_INF;
        if (L != NEG_INF) acc -= expf(sink - L) * bp.d_rows[row];
    }
#endif
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0 && bp.dsinks) bp.dsinks[h] = part[0];
}
