"""The Metal twin of decode_attention's CUDA sources: the same algorithm, block for block
(kipp_mlx/kernels/decode_attention.py describes it and launches both). Rows are read element by
element here (the CUDA twin reads 16-byte vectors); the chunks, the thread a token of the score
phase, the row groups of P V and the merge's order are the same."""

_METAL = """
    constexpr int G = HQ / HKV;
    constexpr int NW = 4;
    constexpr int TPC = 128 / BLOCK_SIZE;
    constexpr int CH = TPC * BLOCK_SIZE;
    constexpr int NV = (CH + 31) / 32;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int NDV = D / VEC;
    constexpr int RSUB = 128 / NDV;
    constexpr int NR = (CH + RSUB - 1) / RSUB;
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
    const int tok0 = s * per * BLOCK_SIZE;
    const int tok1 = min(ctx, (s + 1) * per * BLOCK_SIZE);

    threadgroup float qs[G][D];
    threadgroup float ps[G][CH];
    threadgroup float corr_s[G];
    threadgroup float m_s[G];
    threadgroup float l_s[G];
    threadgroup int blk_s[TPC];
    threadgroup float red[NW][G][D];
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        qs[g][d] = float(q[((size_t)b * HQ + kvh * G + g) * D + d]) * scale[0];
    }
    if (tid < G) { m_s[tid] = NEG_INF; l_s[tid] = 0.0f; }
    float acc[G][VEC];
    for (int g = 0; g < G; g++) for (int i = 0; i < VEC; i++) acc[g][i] = 0.0f;

    for (int c0 = tok0; c0 < tok1; c0 += CH) {
        const int n = min(CH, tok1 - c0);
        if (tid < TPC) {
            const int tile = c0 / BLOCK_SIZE + tid;
            blk_s[tid] = tile < ntiles ? block_tables[(size_t)b * max_blocks + tile] : 0;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid < CH) {
            float dot[G];
            for (int g = 0; g < G; g++) dot[g] = tid < n ? 0.0f : NEG_INF;
            if (tid < n) {
                const size_t slot = (size_t)blk_s[tid / BLOCK_SIZE] * BLOCK_SIZE + tid % BLOCK_SIZE;
                const device T* kr = kv_pool + (slot * 2 * HKV + kvh) * D;
                for (int d = 0; d < D; d++) {
                    const float k = float(kr[d]);
                    for (int g = 0; g < G; g++) dot[g] += qs[g][d] * k;
                }
            }
            for (int g = 0; g < G; g++) ps[g][tid] = dot[g];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int g = warp; g < G; g += NW) {
            float v[NV];
            float cmax = NEG_INF;
            for (int i = 0; i < NV; i++) {
                const int t = i * 32 + lane;
                v[i] = t < CH ? ps[g][t] : NEG_INF;
                cmax = max(cmax, v[i]);
            }
            cmax = simd_max(cmax);
            const float m_old = m_s[g];
            const float m_new = max(m_old, cmax);
            float psum = 0.0f;
            for (int i = 0; i < NV; i++) {
                const int t = i * 32 + lane;
                const float p = metal::exp(v[i] - m_new);
                if (t < CH) ps[g][t] = p;
                psum += p;
            }
            psum = simd_sum(psum);
            if (lane == 0) {
                const float corr = metal::exp(m_old - m_new);
                corr_s[g] = corr;
                l_s[g] = l_s[g] * corr + psum;
                m_s[g] = m_new;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int g = 0; g < G; g++) {
            const float cg = corr_s[g];
            for (int i = 0; i < VEC; i++) acc[g][i] *= cg;
        }
        for (int r = 0; r < NR; r++) {
            const int t = r * RSUB + rsub;
            if (t < n) {
                const size_t slot = (size_t)blk_s[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE;
                const device T* vr = kv_pool + ((slot * 2 + 1) * HKV + kvh) * D + dv * VEC;
                for (int g = 0; g < G; g++) {
                    const float p = ps[g][t];
                    for (int i = 0; i < VEC; i++) acc[g][i] += p * float(vr[i]);
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < VEC; i++) {
            float a = acc[g][i];
            for (int o = NDV; o < 32; o <<= 1) a += simd_shuffle_xor(a, ushort(o));
            if (lane < NDV) red[warp][g][dv * VEC + i] = a;
        }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        float o = red[0][g][d] + red[1][g][d] + red[2][g][d] + red[3][g][d];
        if (DIRECT) o /= l_s[g];
        const size_t row = (size_t)b * HQ + kvh * G + g;
        out[(row * S + s) * D + d] = static_cast<OT>(o);
        if (d == 0) {
            ml[(row * S + s) * 2] = m_s[g];
            ml[(row * S + s) * 2 + 1] = l_s[g];
        }
    }
"""

_METAL_MERGE = """
    const int r = threadgroup_position_in_grid.x;
    const int S = o_part_shape[1];
    const int D = o_part_shape[2];
    const int tid = thread_position_in_threadgroup.x;
    const int warp = tid / 32, lane = tid % 32;
    threadgroup float w_s[128];
    threadgroup float red_s[4];
    const float ms = tid < S ? ml[((size_t)r * S + tid) * 2] : -INFINITY;
    const float wm = simd_max(ms);
    if (lane == 0) red_s[warp] = wm;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float m = max(max(red_s[0], red_s[1]), max(red_s[2], red_s[3]));
    const float w = ms == -INFINITY ? 0.0f : metal::exp(ms - m);
    w_s[tid] = w;
    const float lw = simd_sum(tid < S ? w * ml[((size_t)r * S + tid) * 2 + 1] : 0.0f);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) red_s[warp] = lw;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float den = red_s[0] + red_s[1] + red_s[2] + red_s[3];
    for (int d = tid; d < D; d += 128) {
        float num = 0.0f;
        for (int j = 0; j < S; j++) num += w_s[j] * o_part[((size_t)r * S + j) * D + d];
        out[(size_t)r * D + d] = static_cast<T>(num / den);
    }
"""
