"""The Metal twin of decode_attention's CUDA sources: the same algorithm, block for block
(kipp_mlx/kernels/decode_attention.py describes it and launches both). Rows are read element by
element here (the CUDA twin reads 16-byte vectors); the warps' own 32-token tiles, the lane a token
of the scores, the lanes' V rows, the warps' final merge and the split merge's order are the
same."""

_METAL = """
    constexpr int G = HQ / HKV;
    constexpr int NW = 4;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int NDV = D / VEC;
    constexpr int RPL = 32 / NDV;
    constexpr int NR = 32 / RPL;
    const float NEG_INF = -INFINITY;
    const int s = threadgroup_position_in_grid.x;
    const int kvh = threadgroup_position_in_grid.y;
    const int b = threadgroup_position_in_grid.z;
    const int S = threadgroups_per_grid.x;
    const int tid = thread_position_in_threadgroup.x;
    const int warp = tid / 32, lane = tid % 32;
    const int rsub = lane / NDV, dv = lane % NDV;
    const int ctx = context_lens[b];
    const int per = ((ctx + S - 1) / S + 31) / 32 * 32;
    const int tok0 = s * per;
    const int tok1 = min(ctx, tok0 + per);
    const device int* table = block_tables + (size_t)b * block_tables_shape[1];

    threadgroup float qs[G][D];
    threadgroup float ps[NW][32][G];
    threadgroup float red[NW][G][D];
    threadgroup float m_w[NW][G];
    threadgroup float l_w[NW][G];
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        qs[g][d] = float(q[((size_t)b * HQ + kvh * G + g) * D + d]) * scale[0];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float m[G], l[G], acc[G][VEC];
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
        for (int i = 0; i < VEC; i++) acc[g][i] = 0.0f;
    }

    for (int c = tok0 + warp * 32; c < tok1; c += NW * 32) {
        const int t = c + lane;
        const bool live = t < tok1;
        const int slot = live ? table[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE : 0;
        float sc[G];
        for (int g = 0; g < G; g++) sc[g] = 0.0f;
        if (live) {
            const device T* kr = kv_pool + ((size_t)slot * 2 * HKV + kvh) * D;
            for (int d = 0; d < D; d++) {
                const float k = float(kr[d]);
                for (int g = 0; g < G; g++) sc[g] += qs[g][d] * k;
            }
        }
        for (int g = 0; g < G; g++) {
            const float x = live ? sc[g] : NEG_INF;
            const float m_new = max(m[g], simd_max(x));
            const float corr = metal::exp(m[g] - m_new);
            const float p = metal::exp(x - m_new);
            l[g] = l[g] * corr + simd_sum(p);
            m[g] = m_new;
            for (int i = 0; i < VEC; i++) acc[g][i] *= corr;
            ps[warp][lane][g] = p;
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int r = 0; r < NR; r++) {
            const int tr = r * RPL + rsub;
            const int sr = simd_shuffle(slot, ushort(tr));
            if (c + tr < tok1) {
                const device T* vr = kv_pool + (((size_t)sr * 2 + 1) * HKV + kvh) * D + dv * VEC;
                for (int g = 0; g < G; g++) {
                    const float p = ps[warp][tr][g];
                    for (int i = 0; i < VEC; i++) acc[g][i] += p * float(vr[i]);
                }
            }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < VEC; i++) {
            float a = acc[g][i];
            for (int o = NDV; o < 32; o <<= 1) a += simd_shuffle_xor(a, ushort(o));
            if (lane < NDV) red[warp][g][dv * VEC + i] = a;
        }
    if (lane == 0) {
        for (int g = 0; g < G; g++) { m_w[warp][g] = m[g]; l_w[warp][g] = l[g]; }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        float mx_ = NEG_INF;
        for (int w = 0; w < NW; w++) mx_ = max(mx_, m_w[w][g]);
        float o = 0.0f, den = 0.0f;
        if (mx_ != NEG_INF) {
            for (int w = 0; w < NW; w++) {
                const float f = metal::exp(m_w[w][g] - mx_);
                o += f * red[w][g][d];
                den += f * l_w[w][g];
            }
        }
        if (DIRECT) o /= den;
        const size_t row = (size_t)b * HQ + kvh * G + g;
        out[(row * S + s) * D + d] = static_cast<OT>(o);
        if (d == 0) {
            ml[(row * S + s) * 2] = mx_;
            ml[(row * S + s) * 2 + 1] = den;
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
