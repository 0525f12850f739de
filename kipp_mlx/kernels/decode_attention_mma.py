"""The tensor-core variant of decode_attention's CUDA kernel, for 16-bit caches on CUDA: the same
grid, splits, warp tiles of 32 tokens, online softmax, warp merge and outputs as `_CUDA` in
decode_attention.py, with both products on `mma.sync.m16n8k16` (float32 accumulators) instead of
a thread's scalar FMAs, so a tile costs ~250 instructions a warp instead of ~1,500: at batch 1 a
warp runs alone on its scheduler and the issue chain, not bytes, set the kernel's time.

Layouts (g = lane / 4, t = lane % 4):
- scores S^T = K Q^T, an m-tile a 16 tokens of the tile, n the 8 query heads of the GQA group
  (padding heads' Q is 0). The sum over the head dim is taken in a permuted order: lane (g, t)
  holds dims t * D/4 ... t * D/4 + D/4 - 1 of its K rows (tokens g, g + 8, 16 + g, 24 + g) and
  of Q's head g, so both fragments come from 16-byte loads; k-step s takes dims t * D/4 + 4 s +
  0..3 of every lane, the same for K and Q.
- P goes through shared memory as [head][token] in T, the B fragment of O^T = V^T P^T.
- O^T: an m-tile a 16 dims, n the heads; lane (g, t) loads dims g * D/8 ... of the V rows of
  tokens 2t, 2t + 1, 2t + 8, 2t + 9 (+ 16 a k-step), and m-tile i's rows g and g + 8 are dims
  g * D/8 + i and g * D/8 + D/16 + i, so A fragments are byte permutes of those loads.
"""

_CUDA_MMA_HEADER = """
template <bool BF16>
__device__ __forceinline__ void kipp_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    if constexpr (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}
// two 16-bit halves, one from each word: the low ones (odd = false) or the high ones
__device__ __forceinline__ uint32_t kipp_pair(uint32_t x, uint32_t y, bool odd) {
    return __byte_perm(x, y, odd ? 0x7632 : 0x5410);
}
"""

# after decode_attention's _CUDA_SPLIT (the block's split, tokens and table)
_CUDA_MMA = """
    constexpr int G = HQ / HKV;  // <= 8: the mma's n
    constexpr int NW = 4;
    constexpr int KS = D / 16;  // k-steps of the score mma = m-tiles of the PV mma
    constexpr int DL = D / 4;  // a lane's K (and Q) dims
    constexpr int VL = D / 8;  // a lane's V dims
    constexpr int NK = DL / 8;  // 16-byte vectors of them
    constexpr int NV = VL / 8;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int gq = lane / 4, tq = lane % 4;
    const float qscale = scale[0];

    __shared__ __align__(16) T ps[NW][8][32];
    __shared__ __align__(16) float red[NW][G][D];
    __shared__ float m_w[NW][8], l_w[NW][8];
    uint32_t qf[DL / 2];  // Q^T's B fragments: head gq, dims tq * DL ...
    {
        uint4 qv[NK];
        const uint4* qp =
            reinterpret_cast<const uint4*>(q + ((size_t)b * HQ + kvh * G + gq) * D + tq * DL);
#pragma unroll
        for (int i = 0; i < NK; i++) qv[i] = gq < G ? qp[i] : zero;
#pragma unroll
        for (int i = 0; i < NK; i++) {
            qf[4 * i] = qv[i].x, qf[4 * i + 1] = qv[i].y;
            qf[4 * i + 2] = qv[i].z, qf[4 * i + 3] = qv[i].w;
        }
    }
    float o[KS][4];  // O^T: m-tile i, rows gq / gq + 8, heads 2 tq, 2 tq + 1
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};  // heads 2 tq + e
#pragma unroll
    for (int i = 0; i < KS; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (int c = tok0 + warp * 32; c < tok1; c += NW * 32) {
        const int t = c + lane;
        const int slot = t < tok1 ? table[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE : 0;
        uint4 kr[4][NK];  // K rows of tokens gq + 8 r
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int tr = gq + 8 * r;
            const int sr = __shfl_sync(0xffffffff, slot, tr);
            const uint4* kp = reinterpret_cast<const uint4*>(
                kv_pool + ((size_t)sr * 2 * HKV + kvh) * D + tq * DL);
#pragma unroll
            for (int i = 0; i < NK; i++) kr[r][i] = c + tr < tok1 ? kp[i] : zero;
        }
        uint4 vr[2][4][NV];  // V rows of tokens 16 ks + 2 tq + (j & 1) + 8 (j >> 1); 0 past the end
#pragma unroll
        for (int ks = 0; ks < 2; ks++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int tr = ks * 16 + 2 * tq + (j & 1) + 8 * (j >> 1);
                const int sr = __shfl_sync(0xffffffff, slot, tr);
                const uint4* vp = reinterpret_cast<const uint4*>(
                    kv_pool + (((size_t)sr * 2 + 1) * HKV + kvh) * D + gq * VL);
#pragma unroll
                for (int i = 0; i < NV; i++) vr[ks][j][i] = c + tr < tok1 ? vp[i] : zero;
            }
        float st[2][4];  // S^T: m-tile mt, tokens 16 mt + gq (+ 8 for [2], [3]), heads 2 tq (+ 1)
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            st[mt][0] = st[mt][1] = st[mt][2] = st[mt][3] = 0.0f;
            const uint32_t* k0 = reinterpret_cast<const uint32_t*>(kr[2 * mt]);
            const uint32_t* k1 = reinterpret_cast<const uint32_t*>(kr[2 * mt + 1]);
#pragma unroll
            for (int k = 0; k < KS; k++)
                kipp_mma<BF16>(st[mt], k0[2 * k], k1[2 * k], k0[2 * k + 1], k1[2 * k + 1],
                               qf[2 * k], qf[2 * k + 1]);
        }
        float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const bool live = c + 16 * mt + gq + 8 * h < tok1;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float& x = st[mt][2 * h + e];
                    x = live ? x * qscale : NEG_INF;
                    tmax[e] = fmaxf(tmax[e], x);
                }
            }
        float corr[2], psum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            for (int sh = 4; sh < 32; sh <<= 1)
                tmax[e] = fmaxf(tmax[e], __shfl_xor_sync(0xffffffff, tmax[e], sh));
            const float m_new = fmaxf(m[e], tmax[e]);  // finite: token c is live
            corr[e] = expf(m[e] - m_new);
            m[e] = m_new;
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float p = expf(st[mt][2 * h + e] - m[e]);
                    psum[e] += p;
                    ps[warp][2 * tq + e][16 * mt + gq + 8 * h] = static_cast<T>(p);
                }
#pragma unroll
        for (int e = 0; e < 2; e++) {
            for (int sh = 4; sh < 32; sh <<= 1)
                psum[e] += __shfl_xor_sync(0xffffffff, psum[e], sh);
            l[e] = l[e] * corr[e] + psum[e];
        }
#pragma unroll
        for (int i = 0; i < KS; i++) {
            o[i][0] *= corr[0], o[i][2] *= corr[0];
            o[i][1] *= corr[1], o[i][3] *= corr[1];
        }
        __syncwarp();
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&ps[warp][gq][16 * ks + 2 * tq]);
            const uint32_t b1 =
                *reinterpret_cast<const uint32_t*>(&ps[warp][gq][16 * ks + 2 * tq + 8]);
            const uint32_t* v0 = reinterpret_cast<const uint32_t*>(vr[ks][0]);
            const uint32_t* v1 = reinterpret_cast<const uint32_t*>(vr[ks][1]);
            const uint32_t* v2 = reinterpret_cast<const uint32_t*>(vr[ks][2]);
            const uint32_t* v3 = reinterpret_cast<const uint32_t*>(vr[ks][3]);
#pragma unroll
            for (int i = 0; i < KS; i++) {
                const int e0 = i, e1 = KS + i;  // the lane's V elements of rows gq, gq + 8
                kipp_mma<BF16>(o[i], kipp_pair(v0[e0 / 2], v1[e0 / 2], e0 & 1),
                               kipp_pair(v0[e1 / 2], v1[e1 / 2], e1 & 1),
                               kipp_pair(v2[e0 / 2], v3[e0 / 2], e0 & 1),
                               kipp_pair(v2[e1 / 2], v3[e1 / 2], e1 & 1), b0, b1);
            }
        }
        __syncwarp();  // ps is the next tile's
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int g = 2 * tq + e;
        if (g < G) {
#pragma unroll
            for (int i = 0; i < KS; i++) {
                red[warp][g][gq * VL + i] = o[i][e];
                red[warp][g][gq * VL + KS + i] = o[i][2 + e];
            }
            if (gq == 0) { m_w[warp][g] = m[e]; l_w[warp][g] = l[e]; }
        }
    }
    __syncthreads();
"""
