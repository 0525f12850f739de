"""The Metal twin of decode_attention's CUDA sources: the same algorithm, block for block
(kipp_mlx/kernels/decode_attention.py describes it and launches both)."""

_METAL = """
    constexpr int G = HQ / HKV;
    constexpr int NW = 4;
    constexpr int GW = (G + NW - 1) / NW;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int NDV = D / VEC;
    constexpr int RSUB = 128 / NDV;
    const float NEG_INF = -INFINITY;
    const int s = threadgroup_position_in_grid.x;
    const int kvh = threadgroup_position_in_grid.y;
    const int b = threadgroup_position_in_grid.z;
    const int S = threadgroups_per_grid.x;
    const int tid = thread_position_in_threadgroup.x;
    const int warp = tid / 32, lane = tid % 32;
    const int rsub = tid / NDV, dv = tid % NDV;
    const int max_blocks = block_tables_shape[1];
    const int ctx = context_lens[b];
    const int ntiles = (ctx + BLOCK_SIZE - 1) / BLOCK_SIZE;
    const int per = (ntiles + S - 1) / S;
    const int t0 = s * per;
    const int t1 = min(ntiles, t0 + per);
    const float sc = scale[0];

    threadgroup float qs[G][D];
    threadgroup float ps[G][BLOCK_SIZE];
    threadgroup float corr_s[G];
    threadgroup float ml_s[G][2];
    threadgroup int blk_s;
    threadgroup float red[RSUB][G][D];
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        qs[g][d] = float(q[((size_t)b * HQ + kvh * G + g) * D + d]) * sc;
    }
    float m_run[GW], l_run[GW];
    for (int j = 0; j < GW; j++) { m_run[j] = NEG_INF; l_run[j] = 0.0f; }
    float acc[G][VEC];
    for (int g = 0; g < G; g++) for (int i = 0; i < VEC; i++) acc[g][i] = 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int tile = t0; tile < t1; tile++) {
        if (tid == 0) blk_s = block_tables[(size_t)b * max_blocks + tile];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const size_t base = (size_t)blk_s * BLOCK_SIZE;
        const int n_here = min(BLOCK_SIZE, ctx - tile * BLOCK_SIZE);
        for (int j = 0; j < GW; j++) {
            const int g = warp + j * NW;
            if (g >= G) break;
            float tmax = NEG_INF;
            float sv[(BLOCK_SIZE + 31) / 32];
            for (int c = 0; c * 32 < BLOCK_SIZE; c++) {
                const int t = c * 32 + lane;
                float dot = NEG_INF;
                if (t < n_here) {
                    const device T* kr = kv_pool + (((base + t) * 2) * HKV + kvh) * D;
                    dot = 0.0f;
                    for (int d = 0; d < D; d++) dot += qs[g][d] * float(kr[d]);
                }
                sv[c] = dot;
                tmax = max(tmax, dot);
            }
            tmax = simd_max(tmax);
            const float m_new = max(m_run[j], tmax);
            const float corr = metal::exp(m_run[j] - m_new);
            float psum = 0.0f;
            for (int c = 0; c * 32 < BLOCK_SIZE; c++) {
                const int t = c * 32 + lane;
                const float p = t < n_here ? metal::exp(sv[c] - m_new) : 0.0f;
                if (t < BLOCK_SIZE) ps[g][t] = p;
                psum += p;
            }
            l_run[j] = l_run[j] * corr + simd_sum(psum);
            m_run[j] = m_new;
            if (lane == 0) corr_s[g] = corr;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int g = 0; g < G; g++) {
            const float cg_ = corr_s[g];
            for (int i = 0; i < VEC; i++) acc[g][i] *= cg_;
        }
        for (int t = rsub; t < n_here; t += RSUB) {
            const device T* vr = kv_pool + (((base + t) * 2 + 1) * HKV + kvh) * D + dv * VEC;
            for (int g = 0; g < G; g++) {
                const float p = ps[g][t];
                for (int i = 0; i < VEC; i++) acc[g][i] += p * float(vr[i]);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < VEC; i++) red[rsub][g][dv * VEC + i] = acc[g][i];
    if (lane == 0) {
        for (int j = 0; j < GW; j++) {
            const int g = warp + j * NW;
            if (g < G) { ml_s[g][0] = m_run[j]; ml_s[g][1] = l_run[j]; }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        float o = 0.0f;
        for (int r = 0; r < RSUB; r++) o += red[r][g][d];
        if (DIRECT) o /= ml_s[g][1];
        const size_t row = (size_t)b * HQ + kvh * G + g;
        out[(row * S + s) * D + d] = static_cast<OT>(o);
        if (d == 0) {
            ml[(row * S + s) * 2] = ml_s[g][0];
            ml[(row * S + s) * 2 + 1] = ml_s[g][1];
        }
    }
"""

_METAL_MERGE = """
    const int r = threadgroup_position_in_grid.x;
    const int S = o_part_shape[1];
    const int D = o_part_shape[2];
    float m = -INFINITY;
    for (int s = 0; s < S; s++) m = max(m, ml[((size_t)r * S + s) * 2]);
    for (int d = thread_position_in_threadgroup.x; d < D; d += threads_per_threadgroup.x) {
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < S; s++) {
            const float ms = ml[((size_t)r * S + s) * 2];
            const float w = ms == -INFINITY ? 0.0f : metal::exp(ms - m);
            den += w * ml[((size_t)r * S + s) * 2 + 1];
            num += w * o_part[((size_t)r * S + s) * D + d];
        }
        out[(size_t)r * D + d] = static_cast<T>(num / den);
    }
"""
