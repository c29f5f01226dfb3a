/*
 * fakeblas: a small stand-in for cuBLASLt and cuBLAS, for tests on machines
 * without a GPU. One library exports the entry points metrale uses of both, by
 * their real names, and fakeblas_* control functions; tests point both
 * METRALE_LIBCUBLASLT_PATH and METRALE_LIBCUBLAS_PATH at it.
 *
 * Model:
 *  - "device memory" is the stand-in driver's, which is host memory: a GEMM
 *    reads and writes the pointers it is given, at once, on the calling thread
 *    (the stand-in driver runs queued work when it is queued, too). A GEMM
 *    queued on a stream being captured also runs at once: a capture test checks
 *    what the call was given (workspace, stream), not a replay;
 *  - element types f32, f16, bf16, FP8 e4m3/e5m2 in, f32/f16/bf16 out; scale
 *    type f32; column- or row-ordered layouts; transposes; strided batches;
 *    epilogues ReLU, GELU (tanh form), bias and their bias forms; FP8 per-tensor
 *    A/B/C scales and outer-vector A/B scales (one f32 per row of op(A), per
 *    column of op(B));
 *  - the heuristic is scripted: how many algorithms it returns (0 included),
 *    the workspace each needs (an algorithm needing more than the preference's
 *    limit is not returned, as in cuBLASLt), and its status. An algorithm's
 *    first word is its id (1000 + index), its second the workspace it needs; a
 *    matmul given less workspace than its algorithm needs fails with
 *    CUBLAS_STATUS_NOT_SUPPORTED;
 *  - every GEMM call is recorded: its name, the workspace pointer and size it
 *    was given (for cuBLAS: the handle's, from cublasSetWorkspace), the stream,
 *    the current context and whether that stream was being captured, the
 *    algorithm id; tests read the records to check workspace ownership and
 *    context binding;
 *  - a cuBLAS handle remembers the device current at its creation; a call made
 *    with another device's context current fails with
 *    CUBLAS_STATUS_EXECUTION_FAILED (as a kernel of the wrong context would).
 *
 * Failure control: make a named call fail with a status from its Nth call on;
 * set the versions; count calls by name and live handles of each kind.
 *
 * Built with -DFAKEBLAS_OLD it reports version 12.4.0 and lacks
 * cublasGemmGroupedBatchedEx (added in 12.5), to test the version gate.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int st_t;
enum {
    OK = 0,
    NOT_INITIALIZED = 1,
    ALLOC_FAILED = 3,
    INVALID_VALUE = 7,
    ARCH_MISMATCH = 8,
    EXECUTION_FAILED = 13,
    INTERNAL_ERROR = 14,
    NOT_SUPPORTED = 15,
};

enum { R_32F = 0, R_16F = 2, R_16BF = 14, R_8F_E4M3 = 28, R_8F_E5M2 = 29 };
enum { EPI_DEFAULT = 1, EPI_RELU = 2, EPI_BIAS = 4, EPI_RELU_BIAS = 6, EPI_GELU = 32, EPI_GELU_BIAS = 36 };

/* ---- the stand-in driver, found through METRALE_LIBCUDA_PATH -------------- */

static int (*drv_capturing)(void *);
static int (*drv_device)(void);
static void *(*drv_context)(void);
static void find_driver(void) {
    static int done;
    if (done) return;
    done = 1;
    const char *path = getenv("METRALE_LIBCUDA_PATH");
    if (!path || !*path) return;
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h) return;
    drv_capturing = (int (*)(void *))dlsym(h, "fakecuda_stream_capturing");
    drv_device = (int (*)(void))dlsym(h, "fakecuda_current_device");
    drv_context = (void *(*)(void))dlsym(h, "fakecuda_current_context");
}
static int current_device(void) { return drv_device ? drv_device() : -1; }

/* ---- call accounting and failure injection ------------------------------- */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
#define MAX_NAMES 64
struct call_slot {
    char name[64];
    long calls;
    int fail_status;
    long fail_from, fail_times;
};
static struct call_slot slots[MAX_NAMES];
static struct call_slot *slot(const char *name) {
    for (int i = 0; i < MAX_NAMES; i++) {
        if (slots[i].name[0] == 0) {
            snprintf(slots[i].name, sizeof slots[i].name, "%s", name);
            return &slots[i];
        }
        if (strcmp(slots[i].name, name) == 0) return &slots[i];
    }
    return &slots[MAX_NAMES - 1];
}
/* Count the call; the injected status, if one is due. Called with the lock. */
static st_t enter(const char *name) {
    find_driver();
    struct call_slot *s = slot(name);
    s->calls++;
    if (s->fail_status && s->calls >= s->fail_from &&
        (s->fail_times < 0 || s->calls < s->fail_from + s->fail_times))
        return s->fail_status;
    return OK;
}
#define ENTER(name)                         \
    pthread_mutex_lock(&lock);              \
    do {                                    \
        st_t injected_ = enter(name);       \
        if (injected_) RETURN(injected_);   \
    } while (0)
#define RETURN(v)                           \
    do {                                    \
        st_t r_ = (v);                      \
        pthread_mutex_unlock(&lock);        \
        return r_;                          \
    } while (0)

/* ---- records ---------------------------------------------------------------- */

#define MAX_RECORDS 256
struct record {
    char call[40];
    void *workspace;
    size_t workspace_size;
    void *stream;
    void *context;
    int capturing;
    long long algo;
    int device;
};
static struct record records[MAX_RECORDS];
static long nrecords;
static void record(const char *call, void *ws, size_t ws_size, void *stream, long long algo) {
    struct record *r = &records[nrecords % MAX_RECORDS];
    snprintf(r->call, sizeof r->call, "%s", call);
    r->workspace = ws;
    r->workspace_size = ws_size;
    r->stream = stream;
    r->context = drv_context ? drv_context() : NULL;
    r->capturing = drv_capturing && stream ? drv_capturing(stream) : 0;
    r->algo = algo;
    r->device = current_device();
    nrecords++;
}

/* ---- control ------------------------------------------------------------- */

#ifdef FAKEBLAS_OLD
#define DEFAULT_VERSION 120400
#else
#define DEFAULT_VERSION 130100
#endif
static int version = DEFAULT_VERSION;
static int heuristic_count = 1;
static size_t heuristic_workspace;
static int heuristic_status;
/* The reduction-scheme mask of the preference the last heuristic call was given
 * (7, every scheme, when it set none). */
static unsigned last_reduction_mask;
static int live_lt, live_plain, live_desc, live_layout, live_pref;

EXPORT void fakeblas_reset(void) {
    pthread_mutex_lock(&lock);
    memset(slots, 0, sizeof slots);
    nrecords = 0;
    version = DEFAULT_VERSION;
    heuristic_count = 1;
    heuristic_workspace = 0;
    heuristic_status = OK;
    last_reduction_mask = 0;
    pthread_mutex_unlock(&lock);
}
EXPORT unsigned fakeblas_last_reduction_mask(void) {
    pthread_mutex_lock(&lock);
    unsigned m = last_reduction_mask;
    pthread_mutex_unlock(&lock);
    return m;
}
EXPORT void fakeblas_fail(const char *name, int status, long from_call, long times) {
    pthread_mutex_lock(&lock);
    struct call_slot *s = slot(name);
    s->fail_status = status;
    s->fail_from = s->calls + from_call; /* counted from the next call */
    s->fail_times = times;
    pthread_mutex_unlock(&lock);
}
EXPORT long fakeblas_calls(const char *name) {
    pthread_mutex_lock(&lock);
    long n = slot(name)->calls;
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT void fakeblas_set_version(int v) { version = v; }
/* The heuristic returns min(count, requested) algorithms needing `workspace`
 * bytes each (none when that exceeds the preference's limit), or fails with
 * `status` when it is not 0. */
EXPORT void fakeblas_set_heuristic(int count, size_t workspace, int status) {
    pthread_mutex_lock(&lock);
    heuristic_count = count;
    heuristic_workspace = workspace;
    heuristic_status = status;
    pthread_mutex_unlock(&lock);
}
/* 1 cuBLASLt handles, 2 cuBLAS handles, 3 matmul descriptors, 4 layouts, 5 preferences. */
EXPORT int fakeblas_live(int what) {
    switch (what) {
    case 1: return live_lt;
    case 2: return live_plain;
    case 3: return live_desc;
    case 4: return live_layout;
    case 5: return live_pref;
    default: return -1;
    }
}
EXPORT long fakeblas_records(void) { return nrecords; }
/* Record `i` (0 the oldest kept); 0 when it is not kept. */
EXPORT int fakeblas_record(long i, char *call, size_t call_len, void **ws, size_t *ws_size,
                           void **stream, void **context, int *capturing, long long *algo,
                           int *device) {
    pthread_mutex_lock(&lock);
    long first = nrecords > MAX_RECORDS ? nrecords - MAX_RECORDS : 0;
    if (i < first || i >= nrecords) {
        pthread_mutex_unlock(&lock);
        return 0;
    }
    struct record *r = &records[i % MAX_RECORDS];
    if (call && call_len) snprintf(call, call_len, "%s", r->call);
    *ws = r->workspace;
    *ws_size = r->workspace_size;
    *stream = r->stream;
    *context = r->context;
    *capturing = r->capturing;
    *algo = r->algo;
    *device = r->device;
    pthread_mutex_unlock(&lock);
    return 1;
}

/* ---- numbers -------------------------------------------------------------- */

static float f16_to_f32(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexpf((float)(m | 1024), e - 25);
    return s ? -v : v;
}
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t s = (x >> 16) & 0x8000;
    float a = fabsf(f);
    if (isnan(f)) return s | 0x7e00;
    if (a >= 65520.0f) return s | 0x7c00;
    if (a < ldexpf(1.0f, -14)) return s | (uint16_t)lrintf(a * ldexpf(1.0f, 24));
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    long mant = lrintf(ldexpf(m, 11)); /* 11 bits with the implicit one */
    if (mant == 2048) { mant = 1024; e++; }
    int exp = e - 1 + 15;
    if (exp >= 31) return s | 0x7c00;
    return s | (uint16_t)(exp << 10) | (uint16_t)(mant & 1023);
}
static float bf16_to_f32(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if (isnan(f)) return 0x7fc0;
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}
static float fp8_to_f32(uint8_t b, int e5m2) {
    int s = b >> 7;
    int ebits = e5m2 ? 5 : 4, mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    int e = (b >> mbits) & ((1 << ebits) - 1), m = b & ((1 << mbits) - 1);
    float v;
    if (!e5m2 && e == 15 && m == 7) v = NAN;
    else if (e5m2 && e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexpf((float)m, 1 - bias - mbits);
    else v = ldexpf((float)(m | (1 << mbits)), e - bias - mbits);
    return s ? -v : v;
}
static int elem_size(int type) {
    switch (type) {
    case R_32F: return 4;
    case R_16F: case R_16BF: return 2;
    case R_8F_E4M3: case R_8F_E5M2: return 1;
    default: return 0;
    }
}
static float load(const void *base, size_t i, int type) {
    const unsigned char *p = base;
    switch (type) {
    case R_32F: { float f; memcpy(&f, p + i * 4, 4); return f; }
    case R_16F: { uint16_t h; memcpy(&h, p + i * 2, 2); return f16_to_f32(h); }
    case R_16BF: { uint16_t h; memcpy(&h, p + i * 2, 2); return bf16_to_f32(h); }
    case R_8F_E4M3: return fp8_to_f32(p[i], 0);
    case R_8F_E5M2: return fp8_to_f32(p[i], 1);
    default: return 0;
    }
}
static void store(void *base, size_t i, int type, float v) {
    unsigned char *p = base;
    switch (type) {
    case R_32F: memcpy(p + i * 4, &v, 4); break;
    case R_16F: { uint16_t h = f32_to_f16(v); memcpy(p + i * 2, &h, 2); break; }
    case R_16BF: { uint16_t h = f32_to_bf16(v); memcpy(p + i * 2, &h, 2); break; }
    default: break;
    }
}

/* ---- one strided GEMM over host memory ------------------------------------ */

struct mat {
    const void *p;
    int type, row_major;
    long long rows, cols, ld, stride;
};
static size_t at(const struct mat *m, long long r, long long c, long long batch) {
    long long off = m->row_major ? r * m->ld + c : r + c * m->ld;
    return (size_t)(batch * m->stride + off);
}
struct epi {
    int epilogue;
    const void *bias;
    int bias_type;
    long long bias_stride;
    const float *a_scale, *b_scale, *c_scale, *d_scale;
    int a_outer, b_outer;
};
static float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}
static void gemm(int ta, int tb, long long m, long long n, long long k, float alpha,
                 const struct mat *A, const struct mat *B, float beta, const struct mat *C,
                 void *D, const struct mat *Dl, long long batches, const struct epi *e) {
    for (long long b = 0; b < batches; b++) {
        for (long long j = 0; j < n; j++) {
            for (long long i = 0; i < m; i++) {
                double acc = 0;
                for (long long l = 0; l < k; l++) {
                    float a = ta ? load(A->p, at(A, l, i, b), A->type) : load(A->p, at(A, i, l, b), A->type);
                    float bb = tb ? load(B->p, at(B, j, l, b), B->type) : load(B->p, at(B, l, j, b), B->type);
                    acc += (double)a * bb;
                }
                float sa = 1, sb = 1;
                if (e && e->a_scale) sa = e->a_outer ? e->a_scale[i] : e->a_scale[0];
                if (e && e->b_scale) sb = e->b_scale[e->b_outer ? j : 0];
                float v = alpha * sa * sb * (float)acc;
                if (beta != 0 && C->p) {
                    float sc = e && e->c_scale ? e->c_scale[0] : 1;
                    v += beta * sc * load(C->p, at(C, i, j, b), C->type);
                }
                if (e) {
                    int ep = e->epilogue;
                    if ((ep == EPI_BIAS || ep == EPI_RELU_BIAS || ep == EPI_GELU_BIAS) && e->bias)
                        v += load(e->bias, (size_t)(b * e->bias_stride + i), e->bias_type);
                    if (ep == EPI_RELU || ep == EPI_RELU_BIAS) v = v > 0 ? v : 0;
                    if (ep == EPI_GELU || ep == EPI_GELU_BIAS) v = gelu(v);
                    if (e->d_scale) v *= e->d_scale[0];
                }
                store(D, at(Dl, i, j, b), Dl->type, v);
            }
        }
    }
}

/* ---- cuBLASLt ------------------------------------------------------------- */

#define LT_MAGIC 0x4c54484e
#define DESC_MAGIC 0x44455343
#define LAYOUT_MAGIC 0x4c41594f
#define PREF_MAGIC 0x50524546

struct lt { int magic; int device; };
struct desc {
    int magic;
    int compute, scale_type, pointer_mode, transa, transb, epilogue, bias_type, fast_accum;
    const void *bias;
    long long bias_stride;
    const void *a_scale, *b_scale, *c_scale, *d_scale, *amax_d;
    int a_scale_mode, b_scale_mode;
};
struct layout { int magic; int type, order; unsigned long long rows, cols; long long ld; int batch; long long stride; };
struct pref { int magic; unsigned long long max_ws; unsigned align[4]; unsigned reduction_mask; };

static const char *status_name(st_t s) {
    switch (s) {
    case OK: return "CUBLAS_STATUS_SUCCESS";
    case NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
    }
}
static const char *status_string(st_t s) {
    switch (s) {
    case OK: return "fakeblas: success";
    case INVALID_VALUE: return "fakeblas: an invalid value was given";
    case NOT_SUPPORTED: return "fakeblas: the requested functionality is not supported";
    case EXECUTION_FAILED: return "fakeblas: the GPU program failed to execute";
    case ALLOC_FAILED: return "fakeblas: resource allocation failed";
    default: return "fakeblas: an unknown error";
    }
}
EXPORT const char *cublasLtGetStatusName(st_t s) { return status_name(s); }
EXPORT const char *cublasLtGetStatusString(st_t s) { return status_string(s); }
EXPORT const char *cublasGetStatusName(st_t s) { return status_name(s); }
EXPORT const char *cublasGetStatusString(st_t s) { return status_string(s); }
EXPORT size_t cublasLtGetVersion(void) { return (size_t)version; }

EXPORT st_t cublasLtCreate(struct lt **h) {
    ENTER("cublasLtCreate");
    if (!h) RETURN(INVALID_VALUE);
    struct lt *l = calloc(1, sizeof *l);
    if (!l) RETURN(ALLOC_FAILED);
    l->magic = LT_MAGIC;
    l->device = current_device();
    *h = l;
    live_lt++;
    RETURN(OK);
}
EXPORT st_t cublasLtDestroy(struct lt *h) {
    ENTER("cublasLtDestroy");
    if (!h || h->magic != LT_MAGIC) RETURN(NOT_INITIALIZED);
    h->magic = 0;
    free(h);
    live_lt--;
    RETURN(OK);
}
EXPORT st_t cublasLtMatmulDescCreate(struct desc **d, int compute, int scale_type) {
    ENTER("cublasLtMatmulDescCreate");
    if (!d) RETURN(INVALID_VALUE);
    struct desc *x = calloc(1, sizeof *x);
    if (!x) RETURN(ALLOC_FAILED);
    x->magic = DESC_MAGIC;
    x->compute = compute;
    x->scale_type = scale_type;
    x->epilogue = EPI_DEFAULT;
    x->bias_type = -1;
    *d = x;
    live_desc++;
    RETURN(OK);
}
EXPORT st_t cublasLtMatmulDescDestroy(struct desc *d) {
    ENTER("cublasLtMatmulDescDestroy");
    if (!d || d->magic != DESC_MAGIC) RETURN(INVALID_VALUE);
    d->magic = 0;
    free(d);
    live_desc--;
    RETURN(OK);
}
#define SET(field, type)                                 \
    do {                                                 \
        if (size != sizeof(type)) RETURN(INVALID_VALUE); \
        type v_;                                         \
        memcpy(&v_, buf, sizeof v_);                     \
        d->field = v_;                                   \
    } while (0)
EXPORT st_t cublasLtMatmulDescSetAttribute(struct desc *d, int attr, const void *buf, size_t size) {
    ENTER("cublasLtMatmulDescSetAttribute");
    if (!d || d->magic != DESC_MAGIC || !buf) RETURN(INVALID_VALUE);
    switch (attr) {
    case 2: SET(pointer_mode, int); break;
    case 3: SET(transa, int); break;
    case 4: SET(transb, int); break;
    case 7: SET(epilogue, int); break;
    case 8: SET(bias, const void *); break;
    case 10: SET(bias_stride, long long); break;
    case 17: SET(a_scale, const void *); break;
    case 18: SET(b_scale, const void *); break;
    case 19: SET(c_scale, const void *); break;
    case 20: SET(d_scale, const void *); break;
    case 21: SET(amax_d, const void *); break;
    case 25: SET(fast_accum, signed char); break;
    case 26: SET(bias_type, int); break;
    case 31: SET(a_scale_mode, int); break;
    case 32: SET(b_scale_mode, int); break;
    default: RETURN(INVALID_VALUE);
    }
    RETURN(OK);
}
EXPORT st_t cublasLtMatrixLayoutCreate(struct layout **l, int type, unsigned long long rows,
                                       unsigned long long cols, long long ld) {
    ENTER("cublasLtMatrixLayoutCreate");
    if (!l || !elem_size(type)) RETURN(INVALID_VALUE);
    struct layout *x = calloc(1, sizeof *x);
    if (!x) RETURN(ALLOC_FAILED);
    *x = (struct layout){LAYOUT_MAGIC, type, 0, rows, cols, ld, 1, 0};
    *l = x;
    live_layout++;
    RETURN(OK);
}
EXPORT st_t cublasLtMatrixLayoutDestroy(struct layout *l) {
    ENTER("cublasLtMatrixLayoutDestroy");
    if (!l || l->magic != LAYOUT_MAGIC) RETURN(INVALID_VALUE);
    l->magic = 0;
    free(l);
    live_layout--;
    RETURN(OK);
}
EXPORT st_t cublasLtMatrixLayoutSetAttribute(struct layout *d, int attr, const void *buf, size_t size) {
    ENTER("cublasLtMatrixLayoutSetAttribute");
    if (!d || d->magic != LAYOUT_MAGIC || !buf) RETURN(INVALID_VALUE);
    switch (attr) {
    case 1: SET(order, int); break;
    case 5: SET(batch, int); break;
    case 6: SET(stride, long long); break;
    default: RETURN(INVALID_VALUE);
    }
    RETURN(OK);
}
EXPORT st_t cublasLtMatmulPreferenceCreate(struct pref **p) {
    ENTER("cublasLtMatmulPreferenceCreate");
    if (!p) RETURN(INVALID_VALUE);
    struct pref *x = calloc(1, sizeof *x);
    if (!x) RETURN(ALLOC_FAILED);
    x->magic = PREF_MAGIC;
    x->reduction_mask = 7; /* CUBLASLT_REDUCTION_SCHEME_MASK: every scheme */
    *p = x;
    live_pref++;
    RETURN(OK);
}
EXPORT st_t cublasLtMatmulPreferenceDestroy(struct pref *p) {
    ENTER("cublasLtMatmulPreferenceDestroy");
    if (!p || p->magic != PREF_MAGIC) RETURN(INVALID_VALUE);
    p->magic = 0;
    free(p);
    live_pref--;
    RETURN(OK);
}
EXPORT st_t cublasLtMatmulPreferenceSetAttribute(struct pref *d, int attr, const void *buf, size_t size) {
    ENTER("cublasLtMatmulPreferenceSetAttribute");
    if (!d || d->magic != PREF_MAGIC || !buf) RETURN(INVALID_VALUE);
    if (attr == 1) SET(max_ws, unsigned long long);
    else if (attr == 3) SET(reduction_mask, unsigned); /* CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK */
    else if (attr >= 5 && attr <= 8) SET(align[attr - 5], unsigned);
    else RETURN(INVALID_VALUE);
    RETURN(OK);
}

struct algo { unsigned long long data[8]; };
struct heuristic { struct algo algo; size_t workspace; st_t state; float waves; int reserved[4]; };

static int layouts_ok(struct layout *a, struct layout *b, struct layout *c, struct layout *d) {
    return a && b && c && d && a->magic == LAYOUT_MAGIC && b->magic == LAYOUT_MAGIC &&
           c->magic == LAYOUT_MAGIC && d->magic == LAYOUT_MAGIC;
}
EXPORT st_t cublasLtMatmulAlgoGetHeuristic(struct lt *h, struct desc *op, struct layout *a,
                                           struct layout *b, struct layout *c, struct layout *d,
                                           struct pref *p, int requested, struct heuristic *out,
                                           int *returned) {
    ENTER("cublasLtMatmulAlgoGetHeuristic");
    if (!h || h->magic != LT_MAGIC) RETURN(NOT_INITIALIZED);
    if (!op || op->magic != DESC_MAGIC || !layouts_ok(a, b, c, d) || !p || p->magic != PREF_MAGIC ||
        requested < 1 || !out || !returned)
        RETURN(INVALID_VALUE);
    last_reduction_mask = p->reduction_mask;
    if (heuristic_status) RETURN(heuristic_status);
    int n = heuristic_count < requested ? heuristic_count : requested;
    if (heuristic_workspace > p->max_ws) n = 0;
    for (int i = 0; i < n; i++) {
        memset(&out[i], 0, sizeof out[i]);
        out[i].algo.data[0] = 1000 + (unsigned long long)i;
        out[i].algo.data[1] = heuristic_workspace;
        out[i].workspace = heuristic_workspace;
        out[i].state = OK;
        out[i].waves = 1.0f;
    }
    *returned = n;
    RETURN(OK);
}

static struct mat mat_of(const void *p, const struct layout *l) {
    struct mat m = {p, l->type, l->order == 1, (long long)l->rows, (long long)l->cols, l->ld, l->stride};
    return m;
}
EXPORT st_t cublasLtMatmul(struct lt *h, struct desc *op, const void *alpha, const void *A,
                           struct layout *Ad, const void *B, struct layout *Bd, const void *beta,
                           const void *C, struct layout *Cd, void *D, struct layout *Dd,
                           const struct algo *algo, void *ws, size_t ws_size, void *stream) {
    ENTER("cublasLtMatmul");
    if (!h || h->magic != LT_MAGIC) RETURN(NOT_INITIALIZED);
    if (!op || op->magic != DESC_MAGIC || !layouts_ok(Ad, Bd, Cd, Dd) || !alpha || !beta || !A || !B || !D)
        RETURN(INVALID_VALUE);
    record("cublasLtMatmul", ws, ws_size, stream, algo ? (long long)algo->data[0] : -1);
    if (algo && ws_size < algo->data[1]) RETURN(NOT_SUPPORTED);
    if (Dd->type != R_32F && Dd->type != R_16F && Dd->type != R_16BF) RETURN(NOT_SUPPORTED);
    long long m = (long long)Dd->rows, n = (long long)Dd->cols;
    long long k = op->transa ? (long long)Ad->rows : (long long)Ad->cols;
    struct mat a = mat_of(A, Ad), b = mat_of(B, Bd), c = mat_of(C, Cd), d = mat_of(D, Dd);
    struct epi e = {op->epilogue, op->bias, op->bias_type < 0 ? Dd->type : op->bias_type,
                    op->bias_stride, op->a_scale, op->b_scale, op->c_scale, op->d_scale,
                    op->a_scale_mode == 3, op->b_scale_mode == 3};
    float al, be;
    memcpy(&al, alpha, 4);
    memcpy(&be, beta, 4);
    gemm(op->transa != 0, op->transb != 0, m, n, k, al, &a, &b, be, &c, D, &d, Dd->batch, &e);
    RETURN(OK);
}

/* ---- cuBLAS ----------------------------------------------------------------- */

#define PLAIN_MAGIC 0x43424c53
struct plain {
    int magic, device, math, pointer_mode;
    void *stream;
    void *ws;
    size_t ws_size;
};
static st_t plain_ok(struct plain *h) {
    if (!h || h->magic != PLAIN_MAGIC) return NOT_INITIALIZED;
    if (h->device != current_device()) return EXECUTION_FAILED;
    return OK;
}
EXPORT st_t cublasCreate_v2(struct plain **h) {
    ENTER("cublasCreate_v2");
    if (!h) RETURN(INVALID_VALUE);
    struct plain *p = calloc(1, sizeof *p);
    if (!p) RETURN(ALLOC_FAILED);
    p->magic = PLAIN_MAGIC;
    p->device = current_device();
    *h = p;
    live_plain++;
    RETURN(OK);
}
EXPORT st_t cublasDestroy_v2(struct plain *h) {
    ENTER("cublasDestroy_v2");
    if (!h || h->magic != PLAIN_MAGIC) RETURN(NOT_INITIALIZED);
    h->magic = 0;
    free(h);
    live_plain--;
    RETURN(OK);
}
EXPORT st_t cublasGetVersion_v2(struct plain *h, int *v) {
    (void)h;
    if (!v) return INVALID_VALUE;
    *v = version;
    return OK;
}
EXPORT st_t cublasGetProperty(int which, int *v) {
    if (!v) return INVALID_VALUE;
    switch (which) {
    case 0: *v = version / 10000; return OK;
    case 1: *v = version % 10000 / 100; return OK;
    case 2: *v = version % 100; return OK;
    default: return INVALID_VALUE;
    }
}
EXPORT st_t cublasSetStream_v2(struct plain *h, void *stream) {
    ENTER("cublasSetStream_v2");
    if (!h || h->magic != PLAIN_MAGIC) RETURN(NOT_INITIALIZED);
    h->stream = stream;
    /* As cuBLAS does: a new stream resets the workspace to the default pool. */
    h->ws = NULL;
    h->ws_size = 0;
    RETURN(OK);
}
EXPORT st_t cublasSetWorkspace_v2(struct plain *h, void *ws, size_t size) {
    ENTER("cublasSetWorkspace_v2");
    if (!h || h->magic != PLAIN_MAGIC) RETURN(NOT_INITIALIZED);
    if (size && !ws) RETURN(INVALID_VALUE);
    if (((uintptr_t)ws) % 256) RETURN(INVALID_VALUE);
    h->ws = ws;
    h->ws_size = size;
    RETURN(OK);
}
EXPORT st_t cublasSetMathMode(struct plain *h, int mode) {
    ENTER("cublasSetMathMode");
    if (!h || h->magic != PLAIN_MAGIC) RETURN(NOT_INITIALIZED);
    h->math = mode;
    RETURN(OK);
}
EXPORT st_t cublasGetMathMode(struct plain *h, int *mode) {
    ENTER("cublasGetMathMode");
    if (!h || h->magic != PLAIN_MAGIC) RETURN(NOT_INITIALIZED);
    if (!mode) RETURN(INVALID_VALUE);
    *mode = h->math;
    RETURN(OK);
}
EXPORT st_t cublasSetPointerMode_v2(struct plain *h, int mode) {
    ENTER("cublasSetPointerMode_v2");
    if (!h || h->magic != PLAIN_MAGIC) RETURN(NOT_INITIALIZED);
    if (mode != 0 && mode != 1) RETURN(INVALID_VALUE);
    h->pointer_mode = mode;
    RETURN(OK);
}
EXPORT st_t cublasGetPointerMode_v2(struct plain *h, int *mode) {
    ENTER("cublasGetPointerMode_v2");
    if (!h || h->magic != PLAIN_MAGIC) RETURN(NOT_INITIALIZED);
    if (!mode) RETURN(INVALID_VALUE);
    *mode = h->pointer_mode;
    RETURN(OK);
}
/* Column-major matrices of `type` at `p` with leading dimension `ld`. */
static struct mat col(const void *p, int type, long long rows, long long cols, long long ld, long long stride) {
    struct mat m = {p, type, 0, rows, cols, ld, stride};
    return m;
}
static st_t plain_gemm(const char *call, struct plain *h, int ta, int tb, long long m, long long n,
                       long long k, const void *alpha, const void *A, int at_, long long lda, long long sa,
                       const void *B, int bt, long long ldb, long long sb, const void *beta, void *C,
                       int ct, long long ldc, long long sc, long long batches) {
    st_t s = plain_ok(h);
    if (s) return s;
    if (!alpha || !beta || !elem_size(at_) || !elem_size(bt) || !elem_size(ct)) return INVALID_VALUE;
    if (m < 0 || n < 0 || k < 0 || batches < 0) return INVALID_VALUE;
    if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m || lda < 1 || ldb < 1 || ldc < 1) return INVALID_VALUE;
    record(call, h->ws, h->ws_size, h->stream, -1);
    if (ct != R_32F && ct != R_16F && ct != R_16BF) return NOT_SUPPORTED;
    struct mat a = col(A, at_, ta ? k : m, ta ? m : k, lda, sa);
    struct mat b = col(B, bt, tb ? n : k, tb ? k : n, ldb, sb);
    struct mat c = col(C, ct, m, n, ldc, sc);
    float al, be;
    memcpy(&al, alpha, 4);
    memcpy(&be, beta, 4);
    gemm(ta != 0, tb != 0, m, n, k, al, &a, &b, be, &c, C, &c, batches, NULL);
    return OK;
}
EXPORT st_t cublasGemmEx(struct plain *h, int ta, int tb, int m, int n, int k, const void *alpha,
                         const void *A, int at_, int lda, const void *B, int bt, int ldb,
                         const void *beta, void *C, int ct, int ldc, int compute, int algo) {
    (void)compute;
    (void)algo;
    ENTER("cublasGemmEx");
    RETURN(plain_gemm("cublasGemmEx", h, ta, tb, m, n, k, alpha, A, at_, lda, 0, B, bt, ldb, 0, beta,
                      C, ct, ldc, 0, 1));
}
EXPORT st_t cublasGemmStridedBatchedEx(struct plain *h, int ta, int tb, int m, int n, int k,
                                       const void *alpha, const void *A, int at_, int lda,
                                       long long sa, const void *B, int bt, int ldb, long long sb,
                                       const void *beta, void *C, int ct, int ldc, long long sc,
                                       int batches, int compute, int algo) {
    (void)compute;
    (void)algo;
    ENTER("cublasGemmStridedBatchedEx");
    RETURN(plain_gemm("cublasGemmStridedBatchedEx", h, ta, tb, m, n, k, alpha, A, at_, lda, sa, B, bt,
                      ldb, sb, beta, C, ct, ldc, sc, batches));
}
#ifndef FAKEBLAS_OLD
/* The pointer arrays are "device" memory (host memory here); alpha and beta
 * are one f32 per group, read from host or device as the pointer mode says. */
EXPORT st_t cublasGemmGroupedBatchedEx(struct plain *h, const int *ta, const int *tb, const int *m,
                                       const int *n, const int *k, const void *alpha,
                                       const void *const *A, int at_, const int *lda,
                                       const void *const *B, int bt, const int *ldb,
                                       const void *beta, void *const *C, int ct, const int *ldc,
                                       int groups, const int *group_size, int compute) {
    (void)compute;
    ENTER("cublasGemmGroupedBatchedEx");
    if (groups < 0 || (groups && (!ta || !tb || !m || !n || !k || !alpha || !A || !lda || !B ||
                                  !ldb || !beta || !C || !ldc || !group_size)))
        RETURN(INVALID_VALUE);
    st_t s = plain_ok(h);
    if (s) RETURN(s);
    record("cublasGemmGroupedBatchedEx", h->ws, h->ws_size, h->stream, -1);
    long idx = 0;
    for (int g = 0; g < groups; g++) {
        const float *al = (const float *)alpha + g, *be = (const float *)beta + g;
        for (int i = 0; i < group_size[g]; i++, idx++) {
            struct mat a = col(A[idx], at_, ta[g] ? k[g] : m[g], ta[g] ? m[g] : k[g], lda[g], 0);
            struct mat b = col(B[idx], bt, tb[g] ? n[g] : k[g], tb[g] ? k[g] : n[g], ldb[g], 0);
            struct mat c = col(C[idx], ct, m[g], n[g], ldc[g], 0);
            gemm(ta[g] != 0, tb[g] != 0, m[g], n[g], k[g], *al, &a, &b, *be, &c, C[idx], &c, 1, NULL);
        }
    }
    RETURN(OK);
}
#endif
