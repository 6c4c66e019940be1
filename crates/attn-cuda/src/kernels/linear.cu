// attn_linear: y = x W^T + b (nn.Linear), for the multi-head layer's
// projections: x [rows, in], W [out, in], b [out] or null, y [rows, out],
// all of ELEM, f32 accumulation. A plain shared-memory tiled product: the
// projections are not this crate's subject (cuBLAS is the tool for them);
// this keeps the layer on the device without a host round trip.

#define LT 16

struct LinParams {
    const void* x;
    const void* w;
    const void* b;
    void* y;
    int rows, in_f, out_f, pad0;
};

extern "C" __global__ void __launch_bounds__(LT * LT)
attn_linear(const LinParams p) {
    STATIC_SMEM(float, xs, [LT][LT + 1]);
    STATIC_SMEM(float, ws, [LT][LT + 1]);
    const int tx = threadIdx.x, ty = threadIdx.y;
    // Rows on grid x (up to 2^31 - 1 blocks), features on y.
    const int r = blockIdx.x * LT + ty;   // output row
    const int o = blockIdx.y * LT + tx;   // output feature
    float acc = 0.0f;
    for (int k0 = 0; k0 < p.in_f; k0 += LT) {
        const int xr = blockIdx.x * LT + ty, xk = k0 + tx;
        xs[ty][tx] = (xr < p.rows && xk < p.in_f) ? load_elem(p.x, (i64)xr * p.in_f + xk) : 0.0f;
        const int wo = blockIdx.y * LT + ty, wk = k0 + tx;
        ws[ty][tx] = (wo < p.out_f && wk < p.in_f) ? load_elem(p.w, (i64)wo * p.in_f + wk) : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < LT; ++k) acc = fmaf(xs[ty][k], ws[tx][k], acc);
        __syncthreads();
    }
    if (r < p.rows && o < p.out_f) {
        if (p.b) acc += load_elem(p.b, o);
        store_elem(p.y, (i64)r * p.out_f + o, acc);
    }
}
