/*
 * fakecuda: a small, honest stand-in for the CUDA driver library, for tests on
 * machines without a GPU. It exports the driver entry points metrale uses, by
 * their real (versioned) names, and a few fakecuda_* control functions.
 *
 * Behaviour:
 *  - handles are real heap objects and are checked against a table of live
 *    handles, so an unknown or freed handle gives CUDA_ERROR_INVALID_HANDLE;
 *  - "device" memory is host memory; copies copy;
 *  - a module image is PTX-like text: `.entry NAME(` declares a kernel (its
 *    `.param .TYPE` entries give the parameter sizes), `.global ... NAME[N];`
 *    declares an N-byte global; an image containing "syntax error" fails to
 *    JIT with a log; an ELF or fatbin image is accepted as an empty module;
 *  - a launch records its configuration and the bytes of each parameter.
 *
 * Failure control (through the fakecuda_* exports): make a named call return a
 * status from its Nth call on, for K calls or for ever; switch to "shut down",
 * where every call returns CUDA_ERROR_DEINITIALIZED; count calls by name.
 *
 * Built with -DFAKECUDA_OLD it leaves out entry points a driver before CUDA 12
 * lacks, to test the missing-symbol path.
 *
 * Not thread-safe beyond one big lock: every entry point takes it.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    DEINITIALIZED = 4,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_PTX = 218,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    LAUNCH_OUT_OF_RESOURCES = 701,
    CONTEXT_IS_DESTROYED = 709,
    ILLEGAL_ADDRESS = 700,
    UNKNOWN = 999,
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
/* Body of every exported entry point: count the call under its own name
 * (__func__ of the exported function), apply injected failures, then run body. */
#define LOCKED(body)                                                                \
    do {                                                                            \
        pthread_mutex_lock(&lock);                                                  \
        CUresult r__ = enter(__func__);                                             \
        if (!r__) r__ = (body);                                                     \
        pthread_mutex_unlock(&lock);                                                \
        return r__;                                                                 \
    } while (0)

/* ---- call accounting and failure injection ------------------------------- */

#define MAX_NAMES 128
struct call_slot {
    char name[64];
    long calls;
    int fail_status;  /* 0: no failure armed */
    long fail_from;   /* 1-based call number from which to fail */
    long fail_times;  /* <0: for ever */
};
static struct call_slot slots[MAX_NAMES];
static int shut_down;
static int initialised;
static int driver_version = 13000;
static int no_error_strings;

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

/* Count the call and return the injected status, or 0 to go on. */
static CUresult enter(const char *name) {
    struct call_slot *s = slot(name);
    s->calls++;
    if (shut_down) return DEINITIALIZED;
    if (s->fail_status && s->calls >= s->fail_from &&
        (s->fail_times < 0 || s->calls < s->fail_from + s->fail_times))
        return s->fail_status;
    return SUCCESS;
}
#define NEED_INIT()                                                                 \
    do {                                                                            \
        if (!initialised) return NOT_INITIALIZED;                                   \
    } while (0)

/* ---- live handles --------------------------------------------------------- */

enum kind { K_FREE = 0, K_MODULE, K_FUNC, K_STREAM, K_DEVMEM, K_HOSTMEM };
#define MAX_HANDLES 4096
struct handle {
    void *p;
    enum kind kind;
    size_t bytes;
};
static struct handle handles[MAX_HANDLES];

static void track(void *p, enum kind k, size_t bytes) {
    for (int i = 0; i < MAX_HANDLES; i++)
        if (handles[i].kind == K_FREE) {
            handles[i] = (struct handle){p, k, bytes};
            return;
        }
}
static struct handle *find(const void *p, enum kind k) {
    if (!p) return NULL;
    for (int i = 0; i < MAX_HANDLES; i++)
        if (handles[i].kind == k && handles[i].p == p) return &handles[i];
    return NULL;
}
static int live(enum kind k) {
    int n = 0;
    for (int i = 0; i < MAX_HANDLES; i++) n += handles[i].kind == k;
    return n;
}
/* The live device range (allocation or module global) holding [p, p + n). */
static int device_range_ok(CUdeviceptr p, size_t n);

/* ---- context -------------------------------------------------------------- */

struct ctx {
    int magic;
    int refs;
    int alive;
    unsigned long long id; /* changes each time the context is created anew */
};
static struct ctx primary = {0x43545821, 0, 0, 1};
static __thread struct ctx *current;

/* ---- modules, functions, globals ------------------------------------------ */

#define MAX_PARAMS 32
struct func {
    struct module *owner;
    char name[128];
    int nparams;
    int param_size[MAX_PARAMS];
    int max_dynamic_shared;
};
struct global {
    char name[128];
    unsigned char *data;
    size_t bytes;
};
#define MAX_ITEMS 32
struct module {
    int nfuncs, nglobals;
    struct func *funcs[MAX_ITEMS];
    struct global globals[MAX_ITEMS];
};

static int param_bytes(const char *type) {
    /* .u64 .s32 .f32 .b8 ... : the digits give the width in bits. */
    int bits = atoi(type + 2);
    if (bits <= 0) bits = atoi(type + 1);
    return bits > 0 ? bits / 8 : 8;
}

static void parse_module(struct module *m, const char *text) {
    const char *p = text;
    while ((p = strstr(p, ".entry ")) && m->nfuncs < MAX_ITEMS) {
        p += 7;
        struct func *f = calloc(1, sizeof *f);
        int n = 0;
        while (*p && *p != '(' && *p != ' ' && *p != '\n' && n < 127) f->name[n++] = *p++;
        f->owner = m;
        f->max_dynamic_shared = 48 * 1024;
        const char *open = strchr(p, '('), *close = open ? strchr(open, ')') : NULL;
        for (const char *q = open; q && q < close && f->nparams < MAX_PARAMS;) {
            q = strstr(q, ".param .");
            if (!q || q > close) break;
            f->param_size[f->nparams++] = param_bytes(q + 7);
            q += 8;
        }
        m->funcs[m->nfuncs++] = f;
        track(f, K_FUNC, 0);
    }
    p = text;
    while ((p = strstr(p, ".global ")) && m->nglobals < MAX_ITEMS) {
        const char *end = strchr(p, ';');
        const char *br = strchr(p, '[');
        if (!end) break;
        if (br && br < end) {
            const char *s = br;
            while (s > p && s[-1] != ' ') s--;
            struct global *g = &m->globals[m->nglobals++];
            snprintf(g->name, sizeof g->name, "%.*s", (int)(br - s), s);
            g->bytes = (size_t)atol(br + 1);
            g->data = calloc(1, g->bytes ? g->bytes : 1);
        }
        p = end;
    }
}

static void free_module(struct module *m) {
    for (int i = 0; i < m->nfuncs; i++) {
        struct handle *h = find(m->funcs[i], K_FUNC);
        if (h) h->kind = K_FREE;
        free(m->funcs[i]);
    }
    for (int i = 0; i < m->nglobals; i++) free(m->globals[i].data);
    free(m);
}

static void free_all_handles(void) {
    for (int i = 0; i < MAX_HANDLES; i++) {
        struct handle *h = &handles[i];
        switch (h->kind) {
        case K_MODULE: h->kind = K_FREE; free_module(h->p); break;
        case K_STREAM: case K_DEVMEM: case K_HOSTMEM: h->kind = K_FREE; free(h->p); break;
        default: break;
        }
    }
}

static int device_range_ok(CUdeviceptr p, size_t n) {
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (handles[i].kind == K_DEVMEM) {
            CUdeviceptr b = (CUdeviceptr)(uintptr_t)handles[i].p;
            if (p >= b && p + n <= b + handles[i].bytes) return 1;
        }
        if (handles[i].kind == K_MODULE) {
            struct module *m = handles[i].p;
            for (int g = 0; g < m->nglobals; g++) {
                CUdeviceptr b = (CUdeviceptr)(uintptr_t)m->globals[g].data;
                if (p >= b && p + n <= b + m->globals[g].bytes) return 1;
            }
        }
    }
    return 0;
}

/* ---- the last launch ------------------------------------------------------ */

static struct {
    char kernel[128];
    unsigned grid[3], block[3], shared;
    void *stream;
    int nparams;
    unsigned char params[MAX_PARAMS][8];
    unsigned cluster[3];
    int cooperative;
} last_launch;
static long launches;

/* ---- control -------------------------------------------------------------- */

EXPORT void fakecuda_reset(void) {
    pthread_mutex_lock(&lock);
    memset(slots, 0, sizeof slots);
    shut_down = 0;
    no_error_strings = 0;
    driver_version = 13000;
    memset(&last_launch, 0, sizeof last_launch);
    launches = 0;
    pthread_mutex_unlock(&lock);
}
EXPORT void fakecuda_fail(const char *name, int status, long from_call, long times) {
    pthread_mutex_lock(&lock);
    struct call_slot *s = slot(name);
    s->fail_status = status;
    s->fail_from = s->calls + (from_call < 1 ? 1 : from_call);
    s->fail_times = times;
    pthread_mutex_unlock(&lock);
}
EXPORT void fakecuda_shutdown(int on) {
    pthread_mutex_lock(&lock);
    shut_down = on;
    pthread_mutex_unlock(&lock);
}
EXPORT void fakecuda_set_driver_version(int v) { driver_version = v; }
EXPORT void fakecuda_set_error_strings(int on) { no_error_strings = !on; }
EXPORT long fakecuda_calls(const char *name) {
    pthread_mutex_lock(&lock);
    long n = slot(name)->calls;
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int fakecuda_live(int what) {
    pthread_mutex_lock(&lock);
    int n = live((enum kind)what);
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int fakecuda_primary_refs(void) { return primary.refs; }
EXPORT long fakecuda_launches(void) { return launches; }
/* Copy the last launch's kernel name into buf, and its dims into dims[0..12]:
 * grid xyz, block xyz, shared bytes, parameter count, cluster xyz, cooperative. */
EXPORT void fakecuda_last_launch(char *buf, size_t len, unsigned *dims) {
    pthread_mutex_lock(&lock);
    snprintf(buf, len, "%s", last_launch.kernel);
    for (int i = 0; i < 3; i++) {
        dims[i] = last_launch.grid[i];
        dims[3 + i] = last_launch.block[i];
        dims[8 + i] = last_launch.cluster[i];
    }
    dims[6] = last_launch.shared;
    dims[7] = (unsigned)last_launch.nparams;
    dims[11] = (unsigned)last_launch.cooperative;
    pthread_mutex_unlock(&lock);
}
/* The first 8 bytes (zero-padded) of parameter i of the last launch. */
EXPORT unsigned long long fakecuda_last_param(int i) {
    unsigned long long v = 0;
    if (i >= 0 && i < MAX_PARAMS) memcpy(&v, last_launch.params[i], 8);
    return v;
}
EXPORT int fakecuda_func_max_dynamic_shared(void *f) {
    struct func *fn = f;
    return find(f, K_FUNC) ? fn->max_dynamic_shared : -1;
}

/* ---- errors ---------------------------------------------------------------- */

static const struct {
    int code;
    const char *name, *text;
} errors[] = {
    {SUCCESS, "CUDA_SUCCESS", "no error"},
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

EXPORT CUresult cuGetErrorName(CUresult e, const char **s) {
    if (!s) return INVALID_VALUE;
    *s = NULL;
    if (no_error_strings) return INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == e) {
            *s = errors[i].name;
            return SUCCESS;
        }
    return INVALID_VALUE;
}
EXPORT CUresult cuGetErrorString(CUresult e, const char **s) {
    if (!s) return INVALID_VALUE;
    *s = NULL;
    if (no_error_strings) return INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == e) {
            *s = errors[i].text;
            return SUCCESS;
        }
    return INVALID_VALUE;
}

/* ---- init, version, devices ---------------------------------------------- */

static CUresult do_init(unsigned flags) {
    if (flags) return INVALID_VALUE;
    initialised = 1;
    return SUCCESS;
}
EXPORT CUresult cuInit(unsigned flags) { LOCKED(do_init(flags)); }

static CUresult do_version(int *v) {
    if (!v) return INVALID_VALUE;
    *v = driver_version;
    return SUCCESS;
}
EXPORT CUresult cuDriverGetVersion(int *v) { LOCKED(do_version(v)); }

static CUresult do_count(int *n) {
    NEED_INIT();
    if (!n) return INVALID_VALUE;
    *n = 1;
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) { LOCKED(do_count(n)); }

static CUresult do_device_get(int *dev, int ordinal) {
    NEED_INIT();
    if (!dev) return INVALID_VALUE;
    if (ordinal != 0) return INVALID_DEVICE;
    *dev = 0;
    return SUCCESS;
}
EXPORT CUresult cuDeviceGet(int *dev, int ordinal) { LOCKED(do_device_get(dev, ordinal)); }

static CUresult do_device_name(char *name, int len, int dev) {
    NEED_INIT();
    if (!name || len <= 0) return INVALID_VALUE;
    if (dev != 0) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "fakecuda stand-in device");
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char *name, int len, int dev) {
    LOCKED(do_device_name(name, len, dev));
}

static int attribute(int a) {
    switch (a) {
    case 1: return 1024;         /* max threads per block */
    case 2: case 3: return 1024; /* max block dim x, y */
    case 4: return 64;           /* max block dim z */
    case 5: return 2147483647;   /* max grid dim x */
    case 6: case 7: return 65535;
    case 8: return 48 * 1024;    /* shared memory per block */
    case 10: return 32;          /* warp size */
    case 12: return 65536;       /* registers per block */
    case 16: return 132;         /* multiprocessors */
    case 75: return 9;           /* compute capability */
    case 76: return 0;
    case 81: return 233472;      /* shared memory per multiprocessor */
    case 95: return 1;           /* cooperative launch */
    case 97: return 232448;      /* shared memory per block, opt-in */
    case 120: return 1;          /* cluster launch */
    default: return 0;
    }
}
static CUresult do_attr(int *v, int a, int dev) {
    NEED_INIT();
    if (!v) return INVALID_VALUE;
    if (dev != 0) return INVALID_DEVICE;
    *v = attribute(a);
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int *v, int a, int dev) { LOCKED(do_attr(v, a, dev)); }

/* ---- contexts ------------------------------------------------------------ */

static CUresult do_retain(void **ctx, int dev) {
    NEED_INIT();
    if (!ctx) return INVALID_VALUE;
    if (dev != 0) return INVALID_DEVICE;
    primary.refs++;
    if (!primary.alive) primary.id++;
    primary.alive = 1;
    *ctx = &primary;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { LOCKED(do_retain(ctx, dev)); }

static CUresult do_release(int dev) {
    if (dev != 0) return INVALID_DEVICE;
    if (primary.refs <= 0) return INVALID_CONTEXT;
    if (--primary.refs == 0) primary.alive = 0;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int dev) { LOCKED(do_release(dev)); }

static void free_all_handles(void);

/* Destroys every resource of the primary context; the retains stay, and the
 * context is created anew (with a new id) when it is next made current. */
static CUresult do_reset(int dev) {
    if (dev != 0) return INVALID_DEVICE;
    free_all_handles();
    primary.alive = 0;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxReset_v2(int dev) { LOCKED(do_reset(dev)); }

static CUresult do_get_state(int dev, unsigned *flags, int *active) {
    if (dev != 0) return INVALID_DEVICE;
    if (!flags || !active) return INVALID_VALUE;
    *flags = 0;
    *active = primary.alive;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active) {
    LOCKED(do_get_state(dev, flags, active));
}

#ifndef FAKECUDA_OLD
static CUresult do_ctx_id(void *ctx, unsigned long long *id) {
    if (!id) return INVALID_VALUE;
    if (ctx != &primary) return INVALID_CONTEXT;
    if (!primary.alive) return CONTEXT_IS_DESTROYED;
    *id = primary.id;
    return SUCCESS;
}
EXPORT CUresult cuCtxGetId(void *ctx, unsigned long long *id) { LOCKED(do_ctx_id(ctx, id)); }
#endif

static CUresult do_get_current(void **ctx) {
    if (!ctx) return INVALID_VALUE;
    *ctx = current;
    return SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(void **ctx) { LOCKED(do_get_current(ctx)); }

static CUresult do_set_current(void *ctx) {
    if (ctx && ctx != &primary) return INVALID_CONTEXT;
    if (ctx && !primary.alive) {
        /* A model, not a copy of the real driver: a reset primary context that is
         * still retained is created anew (with a new id) when made current. */
        if (primary.refs <= 0) return CONTEXT_IS_DESTROYED;
        primary.alive = 1;
        primary.id++;
    }
    current = ctx;
    return SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(void *ctx) { LOCKED(do_set_current(ctx)); }

/* Every call that works inside a context checks it like the real driver does. */
#define NEED_CTX()                                                                  \
    do {                                                                            \
        if (!current) return INVALID_CONTEXT;                                       \
        if (!current->alive) return CONTEXT_IS_DESTROYED;                           \
    } while (0)

/* ---- streams ------------------------------------------------------------- */

static CUresult do_stream_create(void **s, unsigned flags) {
    NEED_CTX();
    (void)flags;
    if (!s) return INVALID_VALUE;
    *s = malloc(16);
    track(*s, K_STREAM, 0);
    return SUCCESS;
}
EXPORT CUresult cuStreamCreate(void **s, unsigned flags) { LOCKED(do_stream_create(s, flags)); }

static CUresult do_stream_destroy(void *s) {
    NEED_CTX();
    struct handle *h = find(s, K_STREAM);
    if (!h) return INVALID_HANDLE;
    h->kind = K_FREE;
    free(s);
    return SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(void *s) { LOCKED(do_stream_destroy(s)); }

static CUresult stream_ok(void *s) { return !s || find(s, K_STREAM) ? SUCCESS : INVALID_HANDLE; }

static CUresult do_stream_sync(void *s) {
    NEED_CTX();
    return stream_ok(s);
}
EXPORT CUresult cuStreamSynchronize(void *s) { LOCKED(do_stream_sync(s)); }

/* ---- modules ------------------------------------------------------------- */

static CUresult load(void **mod, const void *image, unsigned n, const int *opts, void **vals) {
    NEED_CTX();
    if (!mod || !image) return INVALID_VALUE;
    const unsigned char *b = image;
    char *error_log = NULL;
    size_t error_len = 0;
    for (unsigned i = 0; i < n; i++) {
        if (opts[i] == 5) error_log = vals[i];
        if (opts[i] == 6) error_len = (size_t)(uintptr_t)vals[i];
    }
    struct module *m = calloc(1, sizeof *m);
    int binary = (b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F') ||
                 (b[0] == 0x50 && b[1] == 0xed && b[2] == 0x55 && b[3] == 0xba);
    if (!binary) {
        const char *text = image;
        if (!(text[0] == '.' || text[0] == '/' || text[0] == ' ' || text[0] == '\n' ||
              text[0] == '\t' || (text[0] >= 'a' && text[0] <= 'z'))) {
            free(m);
            return INVALID_IMAGE;
        }
        if (strstr(text, "syntax error")) {
            if (error_log && error_len)
                snprintf(error_log, error_len,
                         "ptxas application ptx input, line 3; error   : syntax error\n"
                         "ptxas fatal   : Ptx assembly aborted due to errors\n");
            free(m);
            return INVALID_PTX;
        }
        parse_module(m, text);
    }
    track(m, K_MODULE, 0);
    *mod = m;
    return SUCCESS;
}
EXPORT CUresult cuModuleLoadData(void **mod, const void *image) {
    LOCKED(load(mod, image, 0, NULL, NULL));
}
EXPORT CUresult cuModuleLoadDataEx(void **mod, const void *image, unsigned n, int *opts,
                                   void **vals) {
    LOCKED(load(mod, image, n, opts, vals));
}

static CUresult do_unload(void *mod) {
    struct handle *h = find(mod, K_MODULE);
    if (!h) return INVALID_HANDLE;
    h->kind = K_FREE;
    free_module(mod);
    return SUCCESS;
}
EXPORT CUresult cuModuleUnload(void *mod) { LOCKED(do_unload(mod)); }

static CUresult do_get_function(void **f, void *mod, const char *name) {
    NEED_CTX();
    if (!f || !name) return INVALID_VALUE;
    if (!find(mod, K_MODULE)) return INVALID_HANDLE;
    struct module *m = mod;
    for (int i = 0; i < m->nfuncs; i++)
        if (strcmp(m->funcs[i]->name, name) == 0) {
            *f = m->funcs[i];
            return SUCCESS;
        }
    return NOT_FOUND;
}
EXPORT CUresult cuModuleGetFunction(void **f, void *mod, const char *name) {
    LOCKED(do_get_function(f, mod, name));
}

#ifndef FAKECUDA_OLD
static CUresult do_get_global(CUdeviceptr *p, size_t *bytes, void *mod, const char *name) {
    NEED_CTX();
    if (!name) return INVALID_VALUE;
    if (!find(mod, K_MODULE)) return INVALID_HANDLE;
    struct module *m = mod;
    for (int i = 0; i < m->nglobals; i++)
        if (strcmp(m->globals[i].name, name) == 0) {
            if (p) *p = (CUdeviceptr)(uintptr_t)m->globals[i].data;
            if (bytes) *bytes = m->globals[i].bytes;
            return SUCCESS;
        }
    return NOT_FOUND;
}
EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *p, size_t *bytes, void *mod,
                                     const char *name) {
    LOCKED(do_get_global(p, bytes, mod, name));
}

static CUresult do_func_count(unsigned *n, void *mod) {
    if (!n) return INVALID_VALUE;
    if (!find(mod, K_MODULE)) return INVALID_HANDLE;
    *n = (unsigned)((struct module *)mod)->nfuncs;
    return SUCCESS;
}
EXPORT CUresult cuModuleGetFunctionCount(unsigned *n, void *mod) { LOCKED(do_func_count(n, mod)); }

static CUresult do_enumerate(void **fns, unsigned n, void *mod) {
    if (!fns) return INVALID_VALUE;
    if (!find(mod, K_MODULE)) return INVALID_HANDLE;
    struct module *m = mod;
    if (n != (unsigned)m->nfuncs) return INVALID_VALUE;
    for (int i = 0; i < m->nfuncs; i++) fns[i] = m->funcs[i];
    return SUCCESS;
}
EXPORT CUresult cuModuleEnumerateFunctions(void **fns, unsigned n, void *mod) {
    LOCKED(do_enumerate(fns, n, mod));
}

static CUresult do_func_name(const char **name, void *f) {
    if (!name) return INVALID_VALUE;
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    *name = ((struct func *)f)->name;
    return SUCCESS;
}
EXPORT CUresult cuFuncGetName(const char **name, void *f) { LOCKED(do_func_name(name, f)); }
#endif

/* ---- function attributes ------------------------------------------------- */

static CUresult do_func_set(void *f, int attr, int value) {
    NEED_CTX();
    struct handle *h = find(f, K_FUNC);
    if (!h) return INVALID_HANDLE;
    if (attr == 8) {
        if (value < 0 || value > attribute(97)) return INVALID_VALUE;
        ((struct func *)f)->max_dynamic_shared = value;
        return SUCCESS;
    }
    if (attr == 9) return value >= -1 && value <= 100 ? SUCCESS : INVALID_VALUE;
    return INVALID_VALUE;
}
EXPORT CUresult cuFuncSetAttribute(void *f, int attr, int value) {
    LOCKED(do_func_set(f, attr, value));
}

static CUresult do_func_get(int *v, int attr, void *f) {
    NEED_CTX();
    if (!v) return INVALID_VALUE;
    struct func *fn = f;
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    switch (attr) {
    case 0: *v = 1024; break;                       /* max threads per block */
    case 1: *v = 0; break;                          /* static shared */
    case 2: *v = 0; break;                          /* const */
    case 3: *v = 0; break;                          /* local */
    case 4: *v = 16 + 2 * fn->nparams; break;       /* registers */
    case 5: *v = 90; break;                         /* PTX version */
    case 6: *v = 90; break;                         /* binary version */
    case 8: *v = fn->max_dynamic_shared; break;
    case 9: *v = -1; break;
    default: *v = 0;
    }
    return SUCCESS;
}
EXPORT CUresult cuFuncGetAttribute(int *v, int attr, void *f) { LOCKED(do_func_get(v, attr, f)); }

/* ---- launches ------------------------------------------------------------ */

static CUresult record_launch(struct func *fn, const unsigned *grid, const unsigned *block,
                              unsigned shared, void *stream, void **params) {
    for (int i = 0; i < 3; i++)
        if (!grid[i] || !block[i]) return INVALID_VALUE;
    if ((unsigned long long)block[0] * block[1] * block[2] > 1024) return INVALID_VALUE;
    if (block[2] > 64) return INVALID_VALUE;
    if (shared > (unsigned)fn->max_dynamic_shared) return INVALID_VALUE;
    if (stream_ok(stream)) return INVALID_HANDLE;
    if (fn->nparams && !params) return INVALID_VALUE;
    snprintf(last_launch.kernel, sizeof last_launch.kernel, "%s", fn->name);
    memcpy(last_launch.grid, grid, sizeof last_launch.grid);
    memcpy(last_launch.block, block, sizeof last_launch.block);
    last_launch.shared = shared;
    last_launch.stream = stream;
    last_launch.nparams = fn->nparams;
    memset(last_launch.params, 0, sizeof last_launch.params);
    for (int i = 0; i < fn->nparams; i++) {
        int n = fn->param_size[i] > 8 ? 8 : fn->param_size[i];
        memcpy(last_launch.params[i], params[i], (size_t)n);
    }
    memset(last_launch.cluster, 0, sizeof last_launch.cluster);
    last_launch.cooperative = 0;
    launches++;
    return SUCCESS;
}

static CUresult do_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned shared, void *stream,
                          void **params, void **extra) {
    NEED_CTX();
    (void)extra;
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return record_launch(f, grid, block, shared, stream, params);
}
EXPORT CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shared, void *stream,
                               void **params, void **extra) {
    LOCKED(do_launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra));
}

#ifndef FAKECUDA_OLD
struct launch_attr {
    int id;
    int pad;
    union {
        unsigned char bytes[64];
        struct {
            unsigned x, y, z;
        } dim;
        int value;
    } v;
};
struct launch_config {
    unsigned grid[3], block[3], shared;
    void *stream;
    struct launch_attr *attrs;
    unsigned nattrs;
};
static CUresult do_launch_ex(const struct launch_config *c, void *f, void **params,
                             void **extra) {
    NEED_CTX();
    (void)extra;
    if (!c) return INVALID_VALUE;
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    unsigned cluster[3] = {0, 0, 0};
    int coop = 0;
    for (unsigned i = 0; i < c->nattrs; i++) {
        if (c->attrs[i].id == 4) {
            cluster[0] = c->attrs[i].v.dim.x;
            cluster[1] = c->attrs[i].v.dim.y;
            cluster[2] = c->attrs[i].v.dim.z;
            for (int d = 0; d < 3; d++)
                if (!cluster[d] || c->grid[d] % cluster[d]) return INVALID_VALUE;
        }
        if (c->attrs[i].id == 2) coop = c->attrs[i].v.value;
    }
    CUresult r = record_launch(f, c->grid, c->block, c->shared, c->stream, params);
    if (r) return r;
    memcpy(last_launch.cluster, cluster, sizeof cluster);
    last_launch.cooperative = coop;
    return SUCCESS;
}
EXPORT CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
    LOCKED(do_launch_ex(config, f, params, extra));
}
#endif

static CUresult do_occupancy(int *n, void *f, int block, size_t smem) {
    NEED_CTX();
    if (!n || block <= 0) return INVALID_VALUE;
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    int by_threads = 2048 / block;
    int by_smem = smem ? (int)(233472 / smem) : 32;
    *n = by_threads < by_smem ? by_threads : by_smem;
    if (*n > 32) *n = 32;
    return SUCCESS;
}
EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *f, int block,
                                                            size_t smem) {
    LOCKED(do_occupancy(n, f, block, smem));
}

/* A simple occupancy model: 2048 threads, 32 blocks and 233472 bytes of shared
 * memory per multiprocessor, 132 multiprocessors; the largest block size among
 * those reaching the most resident threads wins. */
typedef size_t (*b2d_size)(int block);
static CUresult do_potential(int *grid, int *block, void *f, b2d_size cb, size_t smem,
                             int limit) {
    if (!grid || !block) return INVALID_VALUE;
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    (void)limit;
    int best_block = 0, best_threads = -1, best_blocks = 0;
    for (int b = 1024; b >= 32; b /= 2) {
        size_t bytes = cb ? cb(b) : smem;
        int by_threads = 2048 / b;
        int by_smem = bytes ? (int)(233472 / bytes) : 32;
        int n = by_threads < by_smem ? by_threads : by_smem;
        if (n > 32) n = 32;
        if (n * b > best_threads) {
            best_threads = n * b;
            best_block = b;
            best_blocks = n;
        }
    }
    *block = best_block;
    *grid = best_blocks * 132;
    return SUCCESS;
}
EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *grid, int *block, void *f, b2d_size cb,
                                                 size_t smem, int limit) {
    /* The callback runs under the lock: it must not call back into the driver. */
    LOCKED(do_potential(grid, block, f, cb, smem, limit));
}

/* ---- memory -------------------------------------------------------------- */

static CUresult do_alloc(CUdeviceptr *p, size_t bytes) {
    NEED_CTX();
    if (!p || !bytes) return INVALID_VALUE;
    void *m = malloc(bytes);
    if (!m) return OUT_OF_MEMORY;
    track(m, K_DEVMEM, bytes);
    *p = (CUdeviceptr)(uintptr_t)m;
    return SUCCESS;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) { LOCKED(do_alloc(p, bytes)); }

static CUresult do_free(CUdeviceptr p) {
    NEED_CTX();
    struct handle *h = find((void *)(uintptr_t)p, K_DEVMEM);
    if (!h) return INVALID_VALUE;
    h->kind = K_FREE;
    free((void *)(uintptr_t)p);
    return SUCCESS;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { LOCKED(do_free(p)); }

static CUresult do_alloc_host(void **p, size_t bytes) {
    NEED_CTX();
    if (!p || !bytes) return INVALID_VALUE;
    *p = malloc(bytes);
    if (!*p) return OUT_OF_MEMORY;
    track(*p, K_HOSTMEM, bytes);
    return SUCCESS;
}
EXPORT CUresult cuMemAllocHost_v2(void **p, size_t bytes) { LOCKED(do_alloc_host(p, bytes)); }

static CUresult do_free_host(void *p) {
    NEED_CTX();
    struct handle *h = find(p, K_HOSTMEM);
    if (!h) return INVALID_VALUE;
    h->kind = K_FREE;
    free(p);
    return SUCCESS;
}
EXPORT CUresult cuMemFreeHost(void *p) { LOCKED(do_free_host(p)); }

static CUresult do_htod(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    NEED_CTX();
    if (stream_ok(stream)) return INVALID_HANDLE;
    if (!src || !device_range_ok(dst, n)) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return SUCCESS;
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    LOCKED(do_htod(dst, src, n, stream));
}

static CUresult do_dtoh(void *dst, CUdeviceptr src, size_t n, void *stream) {
    NEED_CTX();
    if (stream_ok(stream)) return INVALID_HANDLE;
    if (!dst || !device_range_ok(src, n)) return INVALID_VALUE;
    memcpy(dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    LOCKED(do_dtoh(dst, src, n, stream));
}
