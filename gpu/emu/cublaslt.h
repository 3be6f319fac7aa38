// kvmesh's CUDA emulator: cuBLASLt's FP8 GEMMs, as the backend asks for them (fp8_gemm.rs):
// e4m3 A and B in the "TN" form, f32 sums and scales, bf16 or f32 D. Included once, inside
// driver.cpp's extern "C" block. The scale layouts follow cuBLAS's documentation of
// cublasLtMatmulMatrixScale_t for an operand stored [inner, outer] (k inner for both):
//   SCALAR_32F      one f32;
//   OUTER_VEC_32F   one per outer index;
//   VEC128_32F      one per 128 inner elements of each outer index, at group * outer + index;
//   BLK128x128_32F  one per 128 x 128 block, the inner blocks of each outer block contiguous
//                   and each such run padded to a multiple of 4.
// Each 128-wide group of k is summed on its own and scaled, as block scaling needs.

struct LtDesc {
    int trans_a = 0, trans_b = 0;
    int mode_a = 0, mode_b = 0;  // CUBLASLT_MATMUL_MATRIX_SCALE_*
    const float* scale_a = nullptr;
    const float* scale_b = nullptr;
};
struct LtLayout {
    int type;
    unsigned long long rows, cols;
    long long ld;
};
const int LT_NOT_SUPPORTED = 15;  // CUBLAS_STATUS_NOT_SUPPORTED

int cublasLtCreate(void** h) {
    *h = new int(0);
    return 0;
}
int cublasLtDestroy(void* h) {
    delete (int*)h;
    return 0;
}
size_t cublasLtGetVersion() { return 130000; }
int cublasLtMatmulDescCreate(void** d, int compute, int scale_type) {
    if (compute != 68 || scale_type != 0) return LT_NOT_SUPPORTED;  // COMPUTE_32F, R_32F
    *d = new LtDesc();
    return 0;
}
int cublasLtMatmulDescDestroy(void* d) {
    delete (LtDesc*)d;
    return 0;
}
int cublasLtMatmulDescSetAttribute(void* desc, int attr, const void* buf, size_t size) {
    LtDesc* d = (LtDesc*)desc;
    auto i32 = [&](int& out) {
        if (size != 4) return 7;  // CUBLAS_STATUS_INVALID_VALUE
        memcpy(&out, buf, 4);
        return 0;
    };
    auto ptr = [&](const float*& out) {
        if (size != 8) return 7;
        memcpy(&out, buf, 8);
        return 0;
    };
    switch (attr) {
        case 3: return i32(d->trans_a);
        case 4: return i32(d->trans_b);
        case 17: return ptr(d->scale_a);
        case 18: return ptr(d->scale_b);
        case 31: return i32(d->mode_a);
        case 32: return i32(d->mode_b);
    }
    return LT_NOT_SUPPORTED;  // an attribute the emulator does not know changes the math
}
int cublasLtMatrixLayoutCreate(void** l, int type, unsigned long long rows,
                               unsigned long long cols, long long ld) {
    *l = new LtLayout{type, rows, cols, ld};
    return 0;
}
int cublasLtMatrixLayoutDestroy(void* l) {
    delete (LtLayout*)l;
    return 0;
}
int cublasLtMatmulPreferenceCreate(void** p) {
    *p = new int(0);
    return 0;
}
int cublasLtMatmulPreferenceDestroy(void* p) {
    delete (int*)p;
    return 0;
}
int cublasLtMatmulPreferenceSetAttribute(void*, int, const void*, size_t) { return 0; }

struct LtHeuristic {  // cublasLtMatmulHeuristicResult_t
    unsigned long long algo[8];
    size_t workspace;
    int state;
    float waves;
    int reserved[4];
};

static bool lt_supported(const LtDesc* d, const LtLayout* a, const LtLayout* b,
                         const LtLayout* dd) {
    const int E4M3 = 28;
    bool modes = (d->mode_a == 5 && d->mode_b == 4) || (d->mode_a == 3 && d->mode_b == 3) ||
                 (d->mode_a == 0 && d->mode_b == 0);
    return d->trans_a == 1 && d->trans_b == 0 && a->type == E4M3 && b->type == E4M3 &&
           (dd->type == 0 || dd->type == 14) && a->rows == b->rows && dd->rows == a->cols &&
           dd->cols == b->cols && modes;
}

int cublasLtMatmulAlgoGetHeuristic(void*, void* desc, void* a, void* b, void*, void* d, void*,
                                   int requested, LtHeuristic* out, int* returned) {
    *returned = 0;
    if (!lt_supported((LtDesc*)desc, (LtLayout*)a, (LtLayout*)b, (LtLayout*)d)) {
        return LT_NOT_SUPPORTED;
    }
    if (requested > 0) {
        memset(out, 0, sizeof *out);
        out->waves = 1.0f;
        *returned = 1;
    }
    return 0;
}

static float e4m3(unsigned char v) {
    int e = (v >> 3) & 15, m = v & 7;
    if (e == 15 && m == 7) return NAN;
    float x = e == 0 ? std::ldexp((float)m, -9) : std::ldexp((float)(8 + m), e - 10);
    return (v & 0x80) ? -x : x;
}

// The scale of group g (of 128 along k) at outer index o, for an operand of `outer` columns
// and `groups` groups.
static float lt_scale(int mode, const float* s, size_t g, size_t o, size_t groups, size_t outer) {
    switch (mode) {
        case 0: return s ? s[0] : 1.0f;
        case 3: return s[o];
        case 4: return s[g * outer + o];
        case 5: return s[(o / 128) * (((groups + 3) / 4) * 4) + g];
    }
    return NAN;
}

int cublasLtMatmul(void*, void* desc, const void* alpha, const void* A, void* a_layout,
                   const void* B, void* b_layout, const void* beta, const void*, void*, void* D,
                   void* d_layout, const void*, void*, size_t, void* stream) {
    LOCK;
    LtDesc d = *(LtDesc*)desc;
    LtLayout la = *(LtLayout*)a_layout, lb = *(LtLayout*)b_layout, ld = *(LtLayout*)d_layout;
    if (!lt_supported(&d, &la, &lb, &ld) || *(const float*)beta != 0.0f) return LT_NOT_SUPPORTED;
    float al = *(const float*)alpha;
    Op op;
    op.kind = Op::CALL;
    op.call = [=] {
        size_t k = la.rows, n = la.cols, m = lb.cols, groups = (k + 127) / 128;
        const unsigned char* a = (const unsigned char*)A;
        const unsigned char* b = (const unsigned char*)B;
        for (size_t j = 0; j < m; j++) {
            for (size_t i = 0; i < n; i++) {
                float acc = 0.0f;
                for (size_t g = 0; g < groups; g++) {
                    float part = 0.0f;
                    for (size_t p = g * 128; p < k && p < (g + 1) * 128; p++) {
                        part += e4m3(a[p + i * la.ld]) * e4m3(b[p + j * lb.ld]);
                    }
                    acc += part * lt_scale(d.mode_a, d.scale_a, g, i, groups, n) *
                           lt_scale(d.mode_b, d.scale_b, g, j, groups, m);
                }
                size_t at = i + j * (size_t)ld.ld;
                if (ld.type == 0) {
                    ((float*)D)[at] = al * acc;
                } else {
                    ((unsigned short*)D)[at] = f32_to_bf16(al * acc);
                }
            }
        }
    };
    return issue(stream, std::move(op)) == OK ? 0 : 13;
}
