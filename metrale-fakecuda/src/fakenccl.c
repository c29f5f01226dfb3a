/*
 * fakenccl: a small stand-in for the NCCL library, for tests on machines
 * without a GPU. It exports the NCCL entry points metrale uses, by their real
 * names, and fakenccl_* control functions.
 *
 * Model:
 *  - ranks are threads (or communicators of one thread, in a group) of one
 *    process; a unique id names an in-process rendezvous (a "clique");
 *  - "device memory" is the stand-in driver's, which is host memory: collectives
 *    read and write the pointers they are given;
 *  - the k-th collective of each rank of a clique is one operation: the rank
 *    that completes it computes the result for all. Until then each waiting
 *    rank's stream is held through the stand-in driver (fakecuda_stream_hold),
 *    so it reads as busy and synchronising it waits, as on a GPU. Sends and
 *    receives match by (sender, receiver, sequence);
 *  - init and split of a blocking communicator wait for all ranks (bounded:
 *    past the rendezvous timeout they fail with ncclSystemError); a
 *    non-blocking one returns ncclInProgress and ncclCommGetAsyncError says
 *    ncclInProgress until every rank joined. Operations of a non-blocking
 *    communicator also report ncclInProgress for a configurable number of
 *    polls;
 *  - a collective queued on a stream being captured runs when queued (the
 *    stand-in driver has no node for it): a capture test checks that nothing
 *    in the call path synchronises, not the replay;
 *  - ncclGroupStart/End defer the calls of this thread to the outermost end;
 *  - NCCL_COMM_BLOCKING (0 or 1) overrides the config's blocking flag, as in
 *    NCCL; the config's commName pointer is kept (NCCL keeps it too) and read
 *    back through fakenccl_comm_name;
 *  - a split of a communicator made with splitShare=1 shares its "resources":
 *    ncclCommGetAsyncError on any of them sleeps for the configured call delay
 *    outside the lock and counts calls that overlap on one shared set
 *    (fakenccl_shared_overlaps; NCCL forbids that concurrency).
 *
 *  - ncclMemAlloc/ncclMemFree allocate through the stand-in driver
 *    (cuMemAlloc_v2/cuMemFree_v2), counted (fakenccl_mem_live); buffer and
 *    window registrations are handles counted while live
 *    (fakenccl_registrations, fakenccl_windows), and those still live when
 *    their communicator goes are counted too (fakenccl_orphaned_registrations);
 *    a symmetric window needs a 4096-byte aligned buffer;
 *  - all-to-all, gather and scatter are computed for real; a pre-multiplied
 *    sum (ncclRedOpCreatePreMulSum, host or device scalar, read when the
 *    operation is queued) scales each rank's input by its own scalar, then sums;
 *  - fakenccl_kill marks a rank dead: its calls fail, and every other rank of
 *    its communicator reports ncclRemoteError; ncclCommRevoke stops a rank's
 *    in-flight operations (their streams are released, nothing is moved) and
 *    refuses new ones; ncclCommShrink makes the survivors a new communicator
 *    (ranks renumbered in order); ncclCommInitRankScalable joins the
 *    rendezvous its ids name together;
 *  - built with -DFAKENCCL_OLD it is an NCCL 2.26.5: no ncclAlltoAll,
 *    ncclGather, ncclScatter, ncclCommRevoke or ncclCommShrink (the window
 *    calls stay, so the version gate, not the symbol, is what refuses them).
 *
 * Failure control: make a named call fail from its Nth call on; set an
 * asynchronous error on a communicator; "hang" (operations never complete, as
 * with a dead peer); make ncclCommAbort take a while (as NCCL's waits for the
 * device's queued work); count calls by name, live communicators, and blocking
 * finalizes or destroys that a real library would have hung in.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef int ncclResult_t;
enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;
    int trafficClass;
    const char *commName;
    int collnetEnable;
    int CTAPolicy;
    int shrinkShare;
    int nvlsCTAs;
    int nChannelsPerNetPeer;
    int nvlinkCentricSched;
} ncclConfig_t;

#define UNDEF_INT (-2147483647 - 1)
#define MAX_RANKS 8
#define MAX_OPS 64
#define MAX_P2P 64
#define MAX_CLIQUES 64
#define COMM_MAGIC 0x4e43434c

enum kind { OP_NONE = 0, OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE, OP_ALLGATHER, OP_REDUCESCATTER, OP_SPLIT,
            OP_ALLTOALL, OP_GATHER, OP_SCATTER };

#ifdef FAKENCCL_OLD
#define DEFAULT_VERSION 22605
#else
#define DEFAULT_VERSION 22809
#endif
#define MAX_PREMUL 8

struct comm;
struct part {
    int in;
    const void *send;
    void *recv;
    size_t count;
    int dtype, op, root;
    void *stream;
    int held;
    struct comm *comm;
    int color, key;      /* split */
    struct comm *child;  /* split: the new communicator (state joining) */
    double scale;        /* pre-multiplied sum: this rank's scalar */
};
struct coll {
    long seq; /* -1: free */
    int kind;
    int arrived;
    int poisoned; /* a rank revoked it: nothing is moved */
    struct part p[MAX_RANKS];
};
struct p2p {
    int used, is_send, from, to;
    long seq;
    void *buf;
    size_t bytes;
    void *stream;
    struct comm *comm;
};
struct clique {
    int used;
    char id[128];
    int nranks, joined;
    struct comm *members[MAX_RANKS];
    struct coll colls[MAX_OPS];
    struct p2p p2p[MAX_P2P];
};
struct comm {
    int magic;
    struct clique *cl;
    int rank, nranks, dev;
    int blocking;
    int ready;      /* every rank joined */
    int failed;     /* init failed (e.g. a split mismatch) */
    int aborted, finalized;
    int async_error;
    int polls_left; /* non-blocking: ncclInProgress answers still to give */
    long seq;
    long send_seq[MAX_RANKS], recv_seq[MAX_RANKS];
    int pending;    /* operations of this rank not yet complete */
    char last_error[256];
    const char *name; /* the config's commName pointer, kept as NCCL keeps it */
    int split_share;  /* the config's splitShare */
    int share_id;     /* the shared set of a splitShare parent and children (0: none) */
    int regs, wins;   /* live registrations and windows */
    int revoked, dead;
    long shrinks;
    struct premul {
        int used, dtype, residence;
        double value;      /* host immediate */
        const void *ptr;   /* device scalar */
    } premul[MAX_PREMUL];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static struct clique cliques[MAX_CLIQUES];
static int live_comms;
static int hang;
static int inprogress_polls;
static long timeout_ms = 10000;
static long would_hang;
static int version_code = DEFAULT_VERSION;
static long mem_live, reg_live, win_live, orphaned, premul_live;
static long win_dereg_delay_us; /* ncclCommWindowDeregister first sleeps this long, unlocked (a peer late to the collective) */
static unsigned long long id_counter;
static __thread char thread_error[256];
#define MAX_SHARES 64
static int share_busy[MAX_SHARES];
static int share_counter;
static long shared_overlaps;
static long call_delay_us;
static long abort_delay_us; /* ncclCommAbort first sleeps this long, unlocked (NCCL's waits for the device's queued work) */

/* NCCL_COMM_BLOCKING: 0 or 1 override the config. */
static int env_blocking(int blocking) {
    const char *e = getenv("NCCL_COMM_BLOCKING");
    if (e && (strcmp(e, "0") == 0 || strcmp(e, "1") == 0)) return e[0] == '1';
    return blocking;
}

/* ---- call accounting and failure injection ------------------------------- */

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
static ncclResult_t enter(const char *name) {
    struct call_slot *s = slot(name);
    s->calls++;
    if (s->fail_status && s->calls >= s->fail_from &&
        (s->fail_times < 0 || s->calls < s->fail_from + s->fail_times)) {
        snprintf(thread_error, sizeof thread_error, "fakenccl: %s failed as asked", name);
        return s->fail_status;
    }
    return ncclSuccess;
}
#define ENTER()                                                                    \
    do {                                                                           \
        ncclResult_t e__ = enter(__func__);                                        \
        if (e__) {                                                                 \
            pthread_mutex_unlock(&lock);                                           \
            return e__;                                                            \
        }                                                                          \
    } while (0)

/* ---- the stand-in driver, found through METRALE_LIBCUDA_PATH -------------- */

static int (*drv_hold)(void *, int);
static int (*drv_capturing)(void *);
static int (*drv_device)(void);
static int (*drv_alloc)(unsigned long long *, size_t);
static int (*drv_free)(unsigned long long);
static void find_driver(void) {
    static int done;
    if (done) return;
    done = 1;
    const char *path = getenv("METRALE_LIBCUDA_PATH");
    if (!path || !*path) return;
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h) return;
    drv_hold = (int (*)(void *, int))dlsym(h, "fakecuda_stream_hold");
    drv_capturing = (int (*)(void *))dlsym(h, "fakecuda_stream_capturing");
    drv_device = (int (*)(void))dlsym(h, "fakecuda_current_device");
    drv_alloc = (int (*)(unsigned long long *, size_t))dlsym(h, "cuMemAlloc_v2");
    drv_free = (int (*)(unsigned long long))dlsym(h, "cuMemFree_v2");
}
static void hold(void *stream, int delta) {
    if (drv_hold && stream) drv_hold(stream, delta);
}

/* ---- control ------------------------------------------------------------- */

EXPORT void fakenccl_reset(void) {
    pthread_mutex_lock(&lock);
    memset(slots, 0, sizeof slots);
    hang = 0;
    inprogress_polls = 0;
    timeout_ms = 10000;
    would_hang = 0;
    version_code = DEFAULT_VERSION;
    orphaned = 0;
    win_dereg_delay_us = 0;
    shared_overlaps = 0;
    call_delay_us = 0;
    abort_delay_us = 0;
    pthread_mutex_unlock(&lock);
}
EXPORT void fakenccl_fail(const char *name, int status, long from_call, long times) {
    pthread_mutex_lock(&lock);
    struct call_slot *s = slot(name);
    s->fail_status = status;
    s->fail_from = from_call;
    s->fail_times = times;
    pthread_mutex_unlock(&lock);
}
EXPORT long fakenccl_calls(const char *name) {
    pthread_mutex_lock(&lock);
    long n = slot(name)->calls;
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int fakenccl_live(void) { return live_comms; }
EXPORT long fakenccl_mem_live(void) { return mem_live; }
EXPORT long fakenccl_registrations(void) { return reg_live; }
EXPORT long fakenccl_windows(void) { return win_live; }
EXPORT long fakenccl_orphaned_registrations(void) { return orphaned; }
EXPORT long fakenccl_premul_live(void) { return premul_live; }
EXPORT void fakenccl_set_window_deregister_delay_us(long us) { win_dereg_delay_us = us; }
/* Kill `comm`'s rank: its calls fail from now on, and every other rank of its
 * communicator reports ncclRemoteError (a peer process died). */
EXPORT void fakenccl_kill(void *comm) {
    pthread_mutex_lock(&lock);
    struct comm *c = comm;
    if (c && c->magic == COMM_MAGIC) {
        c->dead = 1;
        for (int r = 0; c->cl && r < c->cl->nranks; r++) {
            struct comm *m = c->cl->members[r];
            if (!m || m == c) continue;
            m->async_error = ncclRemoteError;
            snprintf(m->last_error, sizeof m->last_error, "fakenccl: rank %d died (killed)", c->rank);
        }
        pthread_cond_broadcast(&changed);
    }
    pthread_mutex_unlock(&lock);
}
EXPORT long fakenccl_would_hang(void) { return would_hang; }
EXPORT void fakenccl_set_hang(int on) { hang = on; }
EXPORT void fakenccl_set_inprogress_polls(int n) { inprogress_polls = n; }
EXPORT void fakenccl_set_timeout_ms(long ms) { timeout_ms = ms; }
EXPORT void fakenccl_set_version(int v) { version_code = v; }
EXPORT void fakenccl_set_async_error(void *comm, int status) {
    pthread_mutex_lock(&lock);
    struct comm *c = comm;
    if (c && c->magic == COMM_MAGIC) {
        c->async_error = status;
        snprintf(c->last_error, sizeof c->last_error, "fakenccl: remote peer failed (injected)");
    }
    pthread_mutex_unlock(&lock);
}
EXPORT void fakenccl_set_call_delay_us(long us) { call_delay_us = us; }
EXPORT void fakenccl_set_abort_delay_us(long us) {
    pthread_mutex_lock(&lock);
    abort_delay_us = us;
    pthread_mutex_unlock(&lock);
}
EXPORT long fakenccl_shared_overlaps(void) { return shared_overlaps; }
/* The commName the communicator was made with, read through the kept pointer. */
EXPORT const char *fakenccl_comm_name(void *comm) {
    struct comm *c = comm;
    return c && c->magic == COMM_MAGIC ? c->name : NULL;
}
EXPORT int fakenccl_pending(void *comm) {
    struct comm *c = comm;
    return c && c->magic == COMM_MAGIC ? c->pending : -1;
}

/* ---- helpers -------------------------------------------------------------- */

static int check_comm(struct comm *c) { return c && c->magic == COMM_MAGIC; }

static ncclResult_t fail(struct comm *c, ncclResult_t r, const char *what) {
    snprintf(thread_error, sizeof thread_error, "%s", what);
    if (c) snprintf(c->last_error, sizeof c->last_error, "%s", what);
    return r;
}

static struct comm *new_comm(int blocking) {
    struct comm *c = calloc(1, sizeof *c);
    c->magic = COMM_MAGIC;
    c->blocking = blocking;
    c->polls_left = blocking ? 0 : inprogress_polls;
    live_comms++;
    return c;
}
static void free_comm(struct comm *c) {
    c->magic = 0;
    live_comms--;
    free(c);
}

/* Wait (the lock released) until cond(arg) holds or the timeout passes. */
static int wait_until(int (*cond)(void *), void *arg) {
    struct timespec end;
    clock_gettime(CLOCK_REALTIME, &end);
    end.tv_sec += timeout_ms / 1000;
    end.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (end.tv_nsec >= 1000000000L) {
        end.tv_sec++;
        end.tv_nsec -= 1000000000L;
    }
    while (!cond(arg))
        if (pthread_cond_timedwait(&changed, &lock, &end)) return cond(arg);
    return 1;
}
static int comm_ready(void *c) { return ((struct comm *)c)->ready || ((struct comm *)c)->failed; }

static size_t type_size(int t) {
    switch (t) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    default: return 0;
    }
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static uint16_t float_to_half(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000);
    int exp = (int)((b >> 23) & 0xff) - 127 + 15;
    uint32_t man = b & 0x7fffff;
    if (((b >> 23) & 0xff) == 0xff) return sign | 0x7c00 | (man ? 0x200 : 0);
    if (exp >= 31) return sign | 0x7c00;
    if (exp <= 0) return sign;
    uint16_t h = (uint16_t)(sign | (exp << 10) | (man >> 13));
    if (man & 0x1000) h++; /* round half up: exact for the small integers tests use */
    return h;
}
static float bf16_to_float(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static uint16_t float_to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x8000) >> 16);
}

/* Combine `n` elements of `src` into `acc` (first: copy). */
#define COMBINE(T)                                                                 \
    do {                                                                           \
        T *a = acc;                                                                \
        const T *s = src;                                                          \
        for (size_t i = 0; i < n; i++) {                                           \
            if (first) { a[i] = s[i]; continue; }                                  \
            switch (op) {                                                          \
            case 1: a[i] = a[i] * s[i]; break;                                     \
            case 2: a[i] = a[i] > s[i] ? a[i] : s[i]; break;                       \
            case 3: a[i] = a[i] < s[i] ? a[i] : s[i]; break;                       \
            default: a[i] = a[i] + s[i];                                           \
            }                                                                      \
        }                                                                          \
    } while (0)
#define FINISH_AVG(T)                                                              \
    do {                                                                           \
        T *a = acc;                                                                \
        for (size_t i = 0; i < n; i++) a[i] = (T)(a[i] / (T)nranks);               \
    } while (0)

/* The switch cases of the NCCL types that are a C type (the half types are
 * not), each running M on it. */
#define C_TYPE_CASES(M)                                                            \
    case 0: M(int8_t); break;                                                      \
    case 1: M(uint8_t); break;                                                     \
    case 2: M(int32_t); break;                                                     \
    case 3: M(uint32_t); break;                                                    \
    case 4: M(int64_t); break;                                                     \
    case 5: M(uint64_t); break;                                                    \
    case 7: M(float); break;                                                       \
    case 8: M(double); break;

/* Half types are reduced in float, in a float accumulator. */
static void combine(void *acc, const void *src, size_t n, int dtype, int op, int first) {
    switch (dtype) {
    C_TYPE_CASES(COMBINE)
    default: break;
    }
}
static void finish_avg(void *acc, size_t n, int dtype, int nranks) {
    switch (dtype) {
    C_TYPE_CASES(FINISH_AVG)
    case 6: case 9: FINISH_AVG(float); break;
    default: break;
    }
}

#define SCALE(T)                                                                   \
    do {                                                                           \
        const T *a = src;                                                          \
        T *o = out;                                                                \
        for (size_t i = 0; i < n; i++) o[i] = (T)(a[i] * s);                       \
    } while (0)
/* A copy of `n` elements of `src`, each times `s` (a pre-multiplied sum). */
static void *scaled_copy(const void *src, size_t n, int dtype, double s) {
    void *out = malloc(n * type_size(dtype) + 1);
    switch (dtype) {
    C_TYPE_CASES(SCALE)
    case 6: case 9: {
        const uint16_t *a = src;
        uint16_t *o = out;
        for (size_t i = 0; i < n; i++) {
            float f = dtype == 6 ? half_to_float(a[i]) : bf16_to_float(a[i]);
            o[i] = dtype == 6 ? float_to_half((float)(f * s)) : float_to_bf16((float)(f * s));
        }
        break;
    }
    default: break;
    }
    return out;
}
static double read_scalar(const void *p, int dtype) {
    switch (dtype) {
    case 0: return *(const int8_t *)p;
    case 1: return *(const uint8_t *)p;
    case 2: return *(const int32_t *)p;
    case 3: return *(const uint32_t *)p;
    case 4: return (double)*(const int64_t *)p;
    case 5: return (double)*(const uint64_t *)p;
    case 6: return half_to_float(*(const uint16_t *)p);
    case 9: return bf16_to_float(*(const uint16_t *)p);
    case 7: return *(const float *)p;
    case 8: return *(const double *)p;
    default: return 0;
    }
}

/* Reduce `nranks` sources of `n` elements into `out` (a separate buffer). */
static void reduce_into(void *out, const void *const *src, int nranks, size_t n, int dtype, int op) {
    if (dtype == 6 || dtype == 9) {
        float *acc = malloc(n * sizeof(float) + 1);
        float *tmp = malloc(n * sizeof(float) + 1);
        for (int r = 0; r < nranks; r++) {
            const uint16_t *s = src[r];
            for (size_t i = 0; i < n; i++) tmp[i] = dtype == 6 ? half_to_float(s[i]) : bf16_to_float(s[i]);
            combine(acc, tmp, n, 7, op, r == 0);
        }
        if (op == 4) finish_avg(acc, n, 7, nranks);
        uint16_t *o = out;
        for (size_t i = 0; i < n; i++) o[i] = dtype == 6 ? float_to_half(acc[i]) : float_to_bf16(acc[i]);
        free(acc);
        free(tmp);
        return;
    }
    for (int r = 0; r < nranks; r++) combine(out, src[r], n, dtype, op, r == 0);
    if (op == 4) finish_avg(out, n, dtype, nranks);
}

static void sort_split(struct part **v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0; j--) {
            struct part *a = v[j - 1], *b = v[j];
            if (a->key < b->key || (a->key == b->key && a->comm->rank < b->comm->rank)) break;
            v[j - 1] = b;
            v[j] = a;
        }
}

static struct clique *new_clique(void) {
    for (int i = 0; i < MAX_CLIQUES; i++)
        if (!cliques[i].used) {
            memset(&cliques[i], 0, sizeof cliques[i]);
            cliques[i].used = 1;
            for (int k = 0; k < MAX_OPS; k++) cliques[i].colls[k].seq = -1;
            return &cliques[i];
        }
    return NULL;
}
static void maybe_free_clique(struct clique *cl) {
    if (!cl) return;
    for (int r = 0; r < cl->nranks; r++)
        if (cl->members[r]) return;
    cl->used = 0;
}

/* Run a complete operation (every rank arrived), then release the holds. */
static void run(struct clique *cl, struct coll *op) {
    int n = cl->nranks;
    size_t es = type_size(op->p[0].dtype);
    size_t count = op->p[0].count;
    int mismatch = 0;
    for (int r = 0; r < n; r++)
        if (op->kind != OP_SPLIT && (op->p[r].count != count || op->p[r].dtype != op->p[0].dtype ||
                                     op->p[r].op != op->p[0].op || op->p[r].root != op->p[0].root))
            mismatch = 1;
    if (mismatch) {
        for (int r = 0; r < n; r++) {
            struct comm *c = op->p[r].comm;
            if (!c) continue;
            c->async_error = ncclInvalidUsage;
            snprintf(c->last_error, sizeof c->last_error,
                     "fakenccl: ranks disagree on the count, type, operation or root of operation %ld", op->seq);
        }
    } else if (!hang && !op->poisoned) {
        const void *src[MAX_RANKS] = {0};
        void *scaled[MAX_RANKS] = {0};
        for (int r = 0; r < n; r++) src[r] = op->p[r].send;
        int rop = op->p[0].op;
        if (rop >= 5 && (op->kind == OP_ALLREDUCE || op->kind == OP_REDUCE || op->kind == OP_REDUCESCATTER)) {
            size_t total = op->kind == OP_REDUCESCATTER ? count * (size_t)n : count;
            for (int r = 0; r < n; r++) {
                scaled[r] = scaled_copy(src[r], total, op->p[0].dtype, op->p[r].scale);
                src[r] = scaled[r];
            }
            rop = 0;
        }
        switch (op->kind) {
        case OP_ALLREDUCE: {
            void *tmp = malloc(count * es + 1);
            reduce_into(tmp, src, n, count, op->p[0].dtype, rop);
            for (int r = 0; r < n; r++) memcpy(op->p[r].recv, tmp, count * es);
            free(tmp);
            break;
        }
        case OP_REDUCE: {
            void *tmp = malloc(count * es + 1);
            reduce_into(tmp, src, n, count, op->p[0].dtype, rop);
            memcpy(op->p[op->p[0].root].recv, tmp, count * es);
            free(tmp);
            break;
        }
        case OP_BROADCAST: {
            void *tmp = malloc(count * es + 1);
            memcpy(tmp, op->p[op->p[0].root].send, count * es);
            for (int r = 0; r < n; r++) memcpy(op->p[r].recv, tmp, count * es);
            free(tmp);
            break;
        }
        case OP_ALLGATHER: {
            char *tmp = malloc(count * es * n + 1);
            for (int r = 0; r < n; r++) memcpy(tmp + (size_t)r * count * es, op->p[r].send, count * es);
            for (int r = 0; r < n; r++) memcpy(op->p[r].recv, tmp, count * es * n);
            free(tmp);
            break;
        }
        case OP_REDUCESCATTER: {
            char *tmp = malloc(count * es * n + 1);
            for (int r = 0; r < n; r++) {
                const void *parts[MAX_RANKS];
                for (int j = 0; j < n; j++) parts[j] = (const char *)src[j] + (size_t)r * count * es;
                reduce_into(tmp + (size_t)r * count * es, parts, n, count, op->p[0].dtype, rop);
            }
            for (int r = 0; r < n; r++) memcpy(op->p[r].recv, tmp + (size_t)r * count * es, count * es);
            free(tmp);
            break;
        }
        case OP_ALLTOALL: {
            /* rank r's block j is rank j's block r */
            size_t b = count * es;
            char *tmp = malloc(b * (size_t)n * (size_t)n + 1);
            for (int r = 0; r < n; r++)
                for (int j = 0; j < n; j++)
                    memcpy(tmp + ((size_t)r * n + j) * b, (const char *)op->p[j].send + (size_t)r * b, b);
            for (int r = 0; r < n; r++) memcpy(op->p[r].recv, tmp + (size_t)r * n * b, b * n);
            free(tmp);
            break;
        }
        case OP_GATHER: {
            size_t b = count * es;
            char *tmp = malloc(b * (size_t)n + 1);
            for (int r = 0; r < n; r++) memcpy(tmp + (size_t)r * b, op->p[r].send, b);
            memcpy(op->p[op->p[0].root].recv, tmp, b * n);
            free(tmp);
            break;
        }
        case OP_SCATTER: {
            size_t b = count * es;
            char *tmp = malloc(b * (size_t)n + 1);
            memcpy(tmp, op->p[op->p[0].root].send, b * n);
            for (int r = 0; r < n; r++) memcpy(op->p[r].recv, tmp + (size_t)r * b, b);
            free(tmp);
            break;
        }
        case OP_SPLIT: {
            struct part *v[MAX_RANKS];
            int done[MAX_RANKS] = {0};
            for (int r = 0; r < n; r++) {
                if (done[r] || op->p[r].color < 0) continue;
                int m = 0;
                for (int j = r; j < n; j++)
                    if (!done[j] && op->p[j].color == op->p[r].color) {
                        v[m++] = &op->p[j];
                        done[j] = 1;
                    }
                sort_split(v, m);
                struct clique *ncl = new_clique();
                if (ncl) {
                    ncl->nranks = m;
                    ncl->joined = m;
                }
                for (int k = 0; k < m; k++) {
                    struct comm *child = v[k]->child;
                    if (!ncl) { child->failed = 1; continue; }
                    child->cl = ncl;
                    child->rank = k;
                    child->nranks = m;
                    child->dev = v[k]->comm->dev;
                    child->ready = 1;
                    ncl->members[k] = child;
                }
            }
            break;
        }
        default:
            break;
        }
        for (int r = 0; r < n; r++) free(scaled[r]);
    }
    if (hang && !mismatch && op->kind != OP_SPLIT) return; /* never completes */
    for (int r = 0; r < n; r++) {
        struct part *p = &op->p[r];
        if (p->held) hold(p->stream, -1);
        if (p->comm) p->comm->pending--;
    }
    op->seq = -1;
    op->kind = OP_NONE;
    op->arrived = 0;
    op->poisoned = 0;
    memset(op->p, 0, sizeof op->p);
    pthread_cond_broadcast(&changed);
}

/* Deposit this rank's part of its next operation; returns the slot. */
static ncclResult_t deposit(struct comm *c, int kind, struct part part) {
    struct clique *cl = c->cl;
    long seq = c->seq++;
    struct coll *op = &cl->colls[seq % MAX_OPS];
    if (op->seq != -1 && op->seq != seq)
        return fail(c, ncclInternalError, "fakenccl: too many operations outstanding");
    if (op->seq == -1) {
        op->seq = seq;
        op->kind = kind;
    } else if (op->kind != kind) {
        c->async_error = ncclInvalidUsage;
        return fail(c, ncclInvalidUsage, "fakenccl: ranks called different collectives");
    }
    part.in = 1;
    part.comm = c;
    part.held = 0;
    int capturing = drv_capturing && part.stream && drv_capturing(part.stream);
    op->p[c->rank] = part;
    op->arrived++;
    c->pending++;
    if (op->arrived == cl->nranks) {
        run(cl, op);
        if (hang && !capturing) { /* the hold of the completing rank too */
            op->p[c->rank].held = 1;
            hold(part.stream, 1);
        }
    } else if (!capturing && kind != OP_SPLIT) {
        op->p[c->rank].held = 1;
        hold(part.stream, 1);
    }
    return ncclSuccess;
}

/* ---- groups --------------------------------------------------------------- */

struct deferred {
    int is_p2p, is_send, kind;
    struct comm *comm;
    struct part part;
    int peer;
    void *buf;
    size_t bytes;
    struct comm **init_out; /* init in a group: wait for it at the end */
};
#define MAX_DEFERRED 256
static __thread int group_depth;
static __thread struct deferred deferred[MAX_DEFERRED];
static __thread int ndeferred;
static __thread struct comm *group_waits[MAX_DEFERRED];
static __thread int nwaits;

static ncclResult_t p2p(struct comm *c, int is_send, void *buf, size_t bytes, int peer, void *stream) {
    struct clique *cl = c->cl;
    int from = is_send ? c->rank : peer, to = is_send ? peer : c->rank;
    long seq = is_send ? c->send_seq[peer]++ : c->recv_seq[peer]++;
    for (int i = 0; i < MAX_P2P; i++) {
        struct p2p *m = &cl->p2p[i];
        if (m->used && m->is_send != is_send && m->from == from && m->to == to && m->seq == seq) {
            const void *src = is_send ? buf : m->buf;
            void *dst = is_send ? m->buf : buf;
            size_t n = bytes < m->bytes ? bytes : m->bytes;
            if (!hang) memcpy(dst, src, n);
            if (!hang) {
                hold(m->stream, -1);
                m->comm->pending--;
                m->used = 0;
            }
            return ncclSuccess;
        }
    }
    for (int i = 0; i < MAX_P2P; i++) {
        struct p2p *m = &cl->p2p[i];
        if (!m->used) {
            *m = (struct p2p){1, is_send, from, to, seq, buf, bytes, stream, c};
            c->pending++;
            hold(stream, 1);
            return ncclSuccess;
        }
    }
    return fail(c, ncclInternalError, "fakenccl: too many sends and receives outstanding");
}

/* ---- entry points --------------------------------------------------------- */

static const char *texts[] = {
    "no error",
    "unhandled cuda error (the stand-in's words)",
    "unhandled system error (the stand-in's words)",
    "internal error (the stand-in's words)",
    "invalid argument (the stand-in's words)",
    "invalid usage (the stand-in's words)",
    "remote process exited or there was a network error (the stand-in's words)",
    "NCCL operation in progress",
};
EXPORT const char *ncclGetErrorString(ncclResult_t r) {
    return r >= 0 && r < 8 ? texts[r] : "unknown result code";
}
EXPORT const char *ncclGetLastError(void *comm) {
    struct comm *c = comm;
    if (check_comm(c) && c->last_error[0]) return c->last_error;
    return thread_error;
}
EXPORT ncclResult_t ncclGetVersion(int *v) {
    pthread_mutex_lock(&lock);
    ENTER();
    pthread_mutex_unlock(&lock);
    if (!v) return ncclInvalidArgument;
    *v = version_code;
    return ncclSuccess;
}
EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    pthread_mutex_lock(&lock);
    ENTER();
    if (!id) { pthread_mutex_unlock(&lock); return fail(NULL, ncclInvalidArgument, "null id"); }
    memset(id, 0, sizeof *id);
    unsigned long long n = ++id_counter;
    unsigned long long t = (unsigned long long)time(NULL);
    memcpy(id->internal, "fakenccl", 8);
    memcpy(id->internal + 8, &n, 8);
    memcpy(id->internal + 16, &t, 8);
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}

static int current_device(void) {
    find_driver();
    int d = drv_device ? drv_device() : 0;
    return d < 0 ? 0 : d;
}

/* Join the clique named by `id` as `rank` (lock held). */
static ncclResult_t join(struct comm **out, int nranks, ncclUniqueId id, int rank, int blocking, int dev) {
    if (nranks < 1 || nranks > MAX_RANKS)
        return fail(NULL, ncclInvalidArgument, "fakenccl: nranks out of range (1 to 8)");
    if (rank < 0 || rank >= nranks) return fail(NULL, ncclInvalidArgument, "fakenccl: rank out of range");
    struct clique *cl = NULL;
    for (int i = 0; i < MAX_CLIQUES; i++)
        if (cliques[i].used && cliques[i].joined < cliques[i].nranks &&
            memcmp(cliques[i].id, id.internal, 128) == 0)
            cl = &cliques[i];
    if (!cl) {
        cl = new_clique();
        if (!cl) return fail(NULL, ncclSystemError, "fakenccl: too many communicators");
        memcpy(cl->id, id.internal, 128);
        cl->nranks = nranks;
    }
    if (cl->nranks != nranks) return fail(NULL, ncclInvalidArgument, "fakenccl: ranks disagree on nranks");
    if (cl->members[rank]) return fail(NULL, ncclInvalidArgument, "fakenccl: rank joined twice");
    struct comm *c = new_comm(blocking);
    c->cl = cl;
    c->rank = rank;
    c->nranks = nranks;
    c->dev = dev;
    cl->members[rank] = c;
    cl->joined++;
    if (cl->joined == cl->nranks) {
        for (int r = 0; r < nranks; r++) cl->members[r]->ready = 1;
        pthread_cond_broadcast(&changed);
    }
    *out = c;
    return ncclSuccess;
}

static ncclResult_t finish_init(struct comm *c) {
    if (!c->blocking) return c->ready && c->polls_left == 0 ? ncclSuccess : ncclInProgress;
    if (group_depth > 0) {
        if (nwaits < MAX_DEFERRED) group_waits[nwaits++] = c;
        return ncclSuccess;
    }
    if (!wait_until(comm_ready, c) || c->failed) {
        snprintf(thread_error, sizeof thread_error,
                 "fakenccl: rendezvous timed out: %d of %d ranks joined", c->cl ? c->cl->joined : 0, c->nranks);
        snprintf(c->last_error, sizeof c->last_error, "%s", thread_error);
        return ncclSystemError;
    }
    return ncclSuccess;
}

/* An init by rank (lock held, the call counted). */
static ncclResult_t init_locked(void **comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config, int dev) {
    if (!comm) return fail(NULL, ncclInvalidArgument, "null comm");
    int blocking = 1;
    if (config) {
        if (config->magic != 0xcafebeef || config->size < 48)
            return fail(NULL, ncclInvalidArgument, "fakenccl: config without NCCL_CONFIG_INITIALIZER");
        if (config->blocking != UNDEF_INT) blocking = config->blocking != 0;
    }
    blocking = env_blocking(blocking);
    struct comm *c = NULL;
    ncclResult_t r = join(&c, nranks, id, rank, blocking, dev);
    if (r) return r;
    if (config) {
        c->name = config->commName;
        c->split_share = config->splitShare == 1;
    }
    *comm = c;
    return finish_init(c);
}

EXPORT ncclResult_t ncclCommInitRankConfig(void **comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
    int dev = current_device();
    pthread_mutex_lock(&lock);
    ENTER();
    ncclResult_t r = init_locked(comm, nranks, id, rank, config, dev);
    pthread_mutex_unlock(&lock);
    return r;
}
/* Several ids: the rendezvous they name together (every rank gives the same). */
EXPORT ncclResult_t ncclCommInitRankScalable(void **comm, int nranks, int rank, int nId, ncclUniqueId *ids,
                                             ncclConfig_t *config) {
    int dev = current_device();
    pthread_mutex_lock(&lock);
    ENTER();
    if (nId < 1 || !ids) {
        pthread_mutex_unlock(&lock);
        return fail(NULL, ncclInvalidArgument, "fakenccl: ncclCommInitRankScalable needs at least one id");
    }
    ncclUniqueId id = ids[0];
    for (int i = 1; i < nId; i++)
        for (int b = 0; b < 128; b++) id.internal[b] ^= (char)(ids[i].internal[b] + i);
    id.internal[127] ^= (char)nId;
    ncclResult_t r = init_locked(comm, nranks, id, rank, config, dev);
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT ncclResult_t ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}
EXPORT ncclResult_t ncclCommInitAll(void **comms, int ndev, const int *devlist) {
    pthread_mutex_lock(&lock);
    ENTER();
    if (!comms || ndev < 1 || ndev > MAX_RANKS) {
        pthread_mutex_unlock(&lock);
        return fail(NULL, ncclInvalidArgument, "fakenccl: ncclCommInitAll: bad arguments");
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    unsigned long long n = ++id_counter;
    memcpy(id.internal, "fakeall", 7);
    memcpy(id.internal + 8, &n, 8);
    for (int r = 0; r < ndev; r++) {
        struct comm *c = NULL;
        ncclResult_t e = join(&c, ndev, id, r, env_blocking(1), devlist ? devlist[r] : r);
        if (e) { pthread_mutex_unlock(&lock); return e; }
        comms[r] = c;
    }
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}

/* A rank that takes no part in a split still waits for the others (the split
 * is collective over the parent). */
struct split_wait {
    struct clique *cl;
    long seq;
};
static int split_done(void *arg) {
    struct split_wait *w = arg;
    return w->cl->colls[w->seq % MAX_OPS].seq != w->seq;
}

EXPORT ncclResult_t ncclCommSplit(void *comm, int color, int key, void **newcomm, ncclConfig_t *config) {
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    if (!check_comm(c) || !newcomm) { pthread_mutex_unlock(&lock); return fail(NULL, ncclInvalidArgument, "bad comm"); }
    int blocking = c->blocking;
    if (config && config->blocking != UNDEF_INT) blocking = config->blocking != 0;
    blocking = env_blocking(blocking);
    struct comm *child = NULL;
    if (color >= 0) {
        child = new_comm(blocking);
        child->nranks = 0;
        if (config) {
            child->name = config->commName;
            child->split_share = config->splitShare == 1;
        }
        if (c->split_share) {
            if (!c->share_id && share_counter + 1 < MAX_SHARES) c->share_id = ++share_counter;
            child->share_id = c->share_id;
        }
    }
    *newcomm = child;
    struct part p = {0};
    p.color = color;
    p.key = key;
    p.child = child;
    struct split_wait w = {c->cl, c->seq};
    ncclResult_t r = deposit(c, OP_SPLIT, p);
    if (!r && !child && blocking && group_depth == 0 && !wait_until(split_done, &w))
        r = fail(c, ncclSystemError, "fakenccl: rendezvous timed out in ncclCommSplit");
    if (r || !child) { pthread_mutex_unlock(&lock); return r; }
    r = finish_init(child);
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT ncclResult_t ncclCommGetAsyncError(void *comm, ncclResult_t *err) {
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    if (!check_comm(c) || !err) { pthread_mutex_unlock(&lock); return ncclInvalidArgument; }
    int share = c->share_id;
    if (share && call_delay_us > 0) {
        /* A call on a shared set: overlapping another one is what NCCL forbids. */
        if (share_busy[share]) shared_overlaps++;
        share_busy[share]++;
        pthread_mutex_unlock(&lock);
        struct timespec d = {call_delay_us / 1000000, (call_delay_us % 1000000) * 1000};
        nanosleep(&d, NULL);
        pthread_mutex_lock(&lock);
        share_busy[share]--;
        if (!check_comm(c)) { pthread_mutex_unlock(&lock); return ncclInvalidArgument; }
    }
    if (c->async_error) *err = c->async_error;
    else if (c->failed) *err = ncclSystemError;
    else if (!c->ready) *err = ncclInProgress;
    else if (!c->blocking && (c->polls_left > 0 || (c->finalized && c->pending > 0))) {
        if (c->polls_left > 0) c->polls_left--;
        *err = ncclInProgress;
    } else *err = ncclSuccess;
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}

#define COMM_INFO(fn, field)                                                       \
    EXPORT ncclResult_t fn(void *comm, int *out) {                                 \
        pthread_mutex_lock(&lock);                                                 \
        ENTER();                                                                   \
        struct comm *c = comm;                                                     \
        ncclResult_t r = ncclSuccess;                                              \
        if (!check_comm(c) || !out) r = ncclInvalidArgument;                       \
        else *out = c->field;                                                      \
        pthread_mutex_unlock(&lock);                                               \
        return r;                                                                  \
    }
COMM_INFO(ncclCommCount, nranks)
COMM_INFO(ncclCommCuDevice, dev)
COMM_INFO(ncclCommUserRank, rank)

EXPORT ncclResult_t ncclCommFinalize(void *comm) {
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    if (!check_comm(c)) { pthread_mutex_unlock(&lock); return ncclInvalidArgument; }
    c->finalized = 1;
    ncclResult_t r = ncclSuccess;
    if (c->blocking && c->pending > 0) {
        would_hang++; /* a real library would block here until the peers came */
        r = fail(c, ncclInternalError, "fakenccl: blocking finalize with operations pending (would hang)");
    } else if (!c->blocking) {
        c->polls_left = inprogress_polls;
        r = ncclInProgress;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static void leave(struct comm *c) {
    struct clique *cl = c->cl;
    /* NCCL frees what is still registered with its communicator. */
    orphaned += c->regs + c->wins;
    reg_live -= c->regs;
    win_live -= c->wins;
    for (int i = 0; i < MAX_PREMUL; i++)
        if (c->premul[i].used) premul_live--;
    if (cl) {
        for (int i = 0; i < MAX_P2P; i++)
            if (cl->p2p[i].used && cl->p2p[i].comm == c) {
                hold(cl->p2p[i].stream, -1);
                cl->p2p[i].used = 0;
            }
        for (int k = 0; k < MAX_OPS; k++) {
            struct coll *op = &cl->colls[k];
            if (op->seq >= 0 && op->p[c->rank].in && op->p[c->rank].comm == c) {
                if (op->p[c->rank].held) hold(op->p[c->rank].stream, -1);
                op->p[c->rank].held = 0;
                op->p[c->rank].comm = NULL;
            }
        }
        if (c->rank < MAX_RANKS && cl->members[c->rank] == c) cl->members[c->rank] = NULL;
        maybe_free_clique(cl);
    }
    free_comm(c);
}

EXPORT ncclResult_t ncclCommDestroy(void *comm) {
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    if (!check_comm(c)) { pthread_mutex_unlock(&lock); return ncclInvalidArgument; }
    if (c->pending > 0) would_hang++;
    leave(c);
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}
EXPORT ncclResult_t ncclCommAbort(void *comm) {
    pthread_mutex_lock(&lock);
    long delay = abort_delay_us;
    pthread_mutex_unlock(&lock);
    if (delay > 0) {
        /* A real abort can wait for the device's queued work (any stream). */
        struct timespec d = {delay / 1000000, (delay % 1000000) * 1000};
        nanosleep(&d, NULL);
    }
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    if (!check_comm(c)) { pthread_mutex_unlock(&lock); return ncclInvalidArgument; }
    c->aborted = 1;
    leave(c);
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}

/* Checks shared by the collectives; lock held. */
static ncclResult_t coll_args(struct comm *c, const void *send, const void *recv, size_t count, int dtype, int op) {
    if (!check_comm(c)) return fail(NULL, ncclInvalidArgument, "fakenccl: invalid communicator");
    if (c->aborted || !c->ready) return fail(c, ncclInvalidUsage, "fakenccl: communicator not ready");
    if (c->dead) return fail(c, ncclSystemError, "fakenccl: this rank was killed");
    if (c->revoked) return fail(c, ncclInvalidUsage, "fakenccl: the communicator was revoked");
    if (c->async_error) return fail(c, c->async_error, c->last_error);
    if (type_size(dtype) == 0 || dtype == 10 || dtype == 11) return fail(c, ncclInvalidArgument, "fakenccl: invalid data type");
    if (op < 0 || (op > 4 && (op - 5 >= MAX_PREMUL || !c->premul[op - 5].used || c->premul[op - 5].dtype != dtype)))
        return fail(c, ncclInvalidArgument, "fakenccl: invalid reduction operation");
    if (count > 0 && (!send || !recv)) return fail(c, ncclInvalidArgument, "fakenccl: null buffer");
    return ncclSuccess;
}

static ncclResult_t submit(struct comm *c, int kind, struct part p) {
    find_driver();
    if (p.op >= 5) {
        struct premul *m = &c->premul[p.op - 5];
        p.scale = m->ptr ? read_scalar(m->ptr, m->dtype) : m->value;
    }
    if (group_depth > 0) {
        if (ndeferred >= MAX_DEFERRED) return fail(c, ncclInternalError, "fakenccl: group too large");
        deferred[ndeferred++] = (struct deferred){0, 0, kind, c, p, 0, NULL, 0, NULL};
        return ncclSuccess;
    }
    ncclResult_t r = deposit(c, kind, p);
    if (!r && !c->blocking && c->polls_left == 0 && inprogress_polls > 0) {
        c->polls_left = inprogress_polls;
        return ncclInProgress;
    }
    return r;
}

#define COLL_ENTRY(call, kind, SEND, RECV, COUNT, OP, ROOT, EXTRA)                 \
    {                                                                              \
        pthread_mutex_lock(&lock);                                                 \
        ENTER();                                                                   \
        struct comm *c = comm;                                                     \
        ncclResult_t r = coll_args(c, SEND, RECV, COUNT, datatype, OP);           \
        if (!r) { EXTRA }                                                          \
        if (!r) {                                                                  \
            struct part p = {0};                                                   \
            p.send = SEND;                                                         \
            p.recv = RECV;                                                         \
            p.count = COUNT;                                                       \
            p.dtype = datatype;                                                    \
            p.op = OP;                                                             \
            p.root = ROOT;                                                         \
            p.stream = stream;                                                     \
            r = submit(c, kind, p);                                                \
        }                                                                          \
        pthread_mutex_unlock(&lock);                                               \
        return r;                                                                  \
    }

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                                  void *comm, void *stream)
    COLL_ENTRY(ncclAllReduce, OP_ALLREDUCE, sendbuff, recvbuff, count, op, 0, ;)

EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                               int root, void *comm, void *stream)
    COLL_ENTRY(ncclReduce, OP_REDUCE, sendbuff, recvbuff, count, op, root,
               if (root < 0 || root >= c->nranks) r = fail(c, ncclInvalidArgument, "fakenccl: root out of range");)

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root,
                                  void *comm, void *stream)
    COLL_ENTRY(ncclBroadcast, OP_BROADCAST, sendbuff, recvbuff, count, 0, root,
               if (root < 0 || root >= c->nranks) r = fail(c, ncclInvalidArgument, "fakenccl: root out of range");)

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype,
                                  void *comm, void *stream)
    COLL_ENTRY(ncclAllGather, OP_ALLGATHER, sendbuff, recvbuff, sendcount, 0, 0, ;)

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, int datatype,
                                      int op, void *comm, void *stream)
    COLL_ENTRY(ncclReduceScatter, OP_REDUCESCATTER, sendbuff, recvbuff, recvcount, op, 0, ;)

static ncclResult_t p2p_entry(int is_send, void *buf, size_t count, int datatype, int peer, void *comm, void *stream) {
    struct comm *c = comm;
    ncclResult_t r = coll_args(c, buf, buf, count, datatype, 0);
    if (r) return r;
    if (peer < 0 || peer >= c->nranks) return fail(c, ncclInvalidArgument, "fakenccl: peer out of range");
    find_driver();
    size_t bytes = count * type_size(datatype);
    if (group_depth > 0) {
        if (ndeferred >= MAX_DEFERRED) return fail(c, ncclInternalError, "fakenccl: group too large");
        struct deferred d = {0};
        d.is_p2p = 1;
        d.is_send = is_send;
        d.comm = c;
        d.peer = peer;
        d.buf = buf;
        d.bytes = bytes;
        d.part.stream = stream;
        deferred[ndeferred++] = d;
        return ncclSuccess;
    }
    return p2p(c, is_send, buf, bytes, peer, stream);
}
EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, int datatype, int peer, void *comm, void *stream) {
    pthread_mutex_lock(&lock);
    ENTER();
    ncclResult_t r = p2p_entry(1, (void *)sendbuff, count, datatype, peer, comm, stream);
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, int datatype, int peer, void *comm, void *stream) {
    pthread_mutex_lock(&lock);
    ENTER();
    ncclResult_t r = p2p_entry(0, recvbuff, count, datatype, peer, comm, stream);
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT ncclResult_t ncclGroupStart(void) {
    pthread_mutex_lock(&lock);
    ENTER();
    group_depth++;
    pthread_mutex_unlock(&lock);
    return ncclSuccess;
}
static int all_ready(void *unused) {
    (void)unused;
    for (int i = 0; i < nwaits; i++)
        if (!group_waits[i]->ready && !group_waits[i]->failed) return 0;
    return 1;
}
EXPORT ncclResult_t ncclGroupEnd(void) {
    pthread_mutex_lock(&lock);
    ENTER();
    if (group_depth == 0) {
        pthread_mutex_unlock(&lock);
        return fail(NULL, ncclInvalidUsage, "fakenccl: ncclGroupEnd without ncclGroupStart");
    }
    if (--group_depth > 0) { pthread_mutex_unlock(&lock); return ncclSuccess; }
    ncclResult_t r = ncclSuccess;
    int nonblocking = 0;
    for (int i = 0; i < ndeferred; i++) {
        struct deferred *d = &deferred[i];
        ncclResult_t e;
        if (!check_comm(d->comm)) e = fail(NULL, ncclInvalidArgument, "fakenccl: communicator freed inside a group");
        else if (d->is_p2p) e = p2p(d->comm, d->is_send, d->buf, d->bytes, d->peer, d->part.stream);
        else e = deposit(d->comm, d->kind, d->part);
        if (check_comm(d->comm) && !d->comm->blocking && inprogress_polls > 0) {
            d->comm->polls_left = inprogress_polls;
            nonblocking = 1;
        }
        if (e && !r) r = e;
    }
    ndeferred = 0;
    if (!r && nwaits > 0) {
        if (!wait_until(all_ready, NULL)) r = fail(NULL, ncclSystemError, "fakenccl: rendezvous timed out in a group");
        for (int i = 0; i < nwaits && !r; i++)
            if (group_waits[i]->failed) r = ncclSystemError;
    }
    nwaits = 0;
    pthread_mutex_unlock(&lock);
    if (!r && nonblocking) return ncclInProgress;
    return r;
}

/* ---- NCCL memory, registrations, windows ---------------------------------- */

/* ncclMemAlloc's buffers are 4096-byte aligned (as NCCL's are): each is a
 * stand-in driver allocation 4096 bytes larger, remembered to be freed. */
#define MAX_NCCL_MEM 256
static struct { unsigned long long base; uintptr_t aligned; } nccl_mem[MAX_NCCL_MEM];
EXPORT ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
    find_driver();
    pthread_mutex_lock(&lock);
    ENTER();
    pthread_mutex_unlock(&lock);
    if (!ptr) return fail(NULL, ncclInvalidArgument, "fakenccl: ncclMemAlloc: null pointer");
    if (!drv_alloc) return fail(NULL, ncclUnhandledCudaError, "fakenccl: no stand-in driver loaded");
    unsigned long long d = 0;
    if (drv_alloc(&d, size + 4096)) return fail(NULL, ncclUnhandledCudaError, "fakenccl: cuMemAlloc failed");
    uintptr_t a = ((uintptr_t)d + 4095) & ~(uintptr_t)4095;
    pthread_mutex_lock(&lock);
    int slot_i = -1;
    for (int i = 0; i < MAX_NCCL_MEM && slot_i < 0; i++)
        if (!nccl_mem[i].aligned) slot_i = i;
    if (slot_i < 0) {
        pthread_mutex_unlock(&lock);
        drv_free(d);
        return fail(NULL, ncclInternalError, "fakenccl: too many ncclMemAlloc buffers");
    }
    nccl_mem[slot_i].base = d;
    nccl_mem[slot_i].aligned = a;
    mem_live++;
    pthread_mutex_unlock(&lock);
    *ptr = (void *)a;
    return ncclSuccess;
}
EXPORT ncclResult_t ncclMemFree(void *ptr) {
    find_driver();
    pthread_mutex_lock(&lock);
    ENTER();
    if (!ptr) { pthread_mutex_unlock(&lock); return ncclSuccess; }
    unsigned long long base = 0;
    for (int i = 0; i < MAX_NCCL_MEM; i++)
        if (nccl_mem[i].aligned == (uintptr_t)ptr) {
            base = nccl_mem[i].base;
            nccl_mem[i].aligned = 0;
            mem_live--;
            break;
        }
    pthread_mutex_unlock(&lock);
    if (!base) return fail(NULL, ncclInvalidArgument, "fakenccl: ncclMemFree of a pointer ncclMemAlloc did not give");
    if (!drv_free) return fail(NULL, ncclUnhandledCudaError, "fakenccl: no stand-in driver loaded");
    if (drv_free(base)) return fail(NULL, ncclUnhandledCudaError, "fakenccl: cuMemFree failed");
    return ncclSuccess;
}

#define REG_MAGIC 0x52454721
struct reg {
    int magic;
    struct comm *comm;
    void *buf;
    size_t size;
    int window, flags;
};
static ncclResult_t add_reg(struct comm *c, void *buff, size_t size, void **out, int window, int flags) {
    if (!check_comm(c) || !out) return fail(NULL, ncclInvalidArgument, "fakenccl: invalid communicator");
    if (c->revoked || c->dead) return fail(c, ncclInvalidUsage, "fakenccl: the communicator was revoked");
    if (!buff || !size) return fail(c, ncclInvalidArgument, "fakenccl: registering an empty buffer");
    if (window && (flags & 1) && ((uintptr_t)buff % 4096))
        return fail(c, ncclInvalidArgument, "fakenccl: a symmetric window needs a 4096-byte aligned buffer");
    struct reg *g = calloc(1, sizeof *g);
    *g = (struct reg){REG_MAGIC, c, buff, size, window, flags};
    if (window) { c->wins++; win_live++; }
    else { c->regs++; reg_live++; }
    *out = g;
    return ncclSuccess;
}
static ncclResult_t drop_reg(struct comm *c, void *handle, int window) {
    struct reg *g = handle;
    if (!check_comm(c)) return fail(NULL, ncclInvalidArgument, "fakenccl: invalid communicator");
    if (!g || g->magic != REG_MAGIC || g->comm != c || g->window != window)
        return fail(c, ncclInvalidArgument, "fakenccl: not a registration of this communicator");
    g->magic = 0;
    if (window) { c->wins--; win_live--; }
    else { c->regs--; reg_live--; }
    free(g);
    return ncclSuccess;
}
/* The body of an entry point that runs `expr` under the lock, counted. */
#define LOCKED_ENTRY(expr)                                                         \
    {                                                                              \
        pthread_mutex_lock(&lock);                                                 \
        ENTER();                                                                   \
        ncclResult_t r = (expr);                                                   \
        pthread_mutex_unlock(&lock);                                               \
        return r;                                                                  \
    }
EXPORT ncclResult_t ncclCommRegister(void *comm, void *buff, size_t size, void **handle)
    LOCKED_ENTRY(add_reg(comm, buff, size, handle, 0, 0))
EXPORT ncclResult_t ncclCommDeregister(void *comm, void *handle) LOCKED_ENTRY(drop_reg(comm, handle, 0))
EXPORT ncclResult_t ncclCommWindowRegister(void *comm, void *buff, size_t size, void **win, int flags)
    LOCKED_ENTRY(add_reg(comm, buff, size, win, 1, flags))
EXPORT ncclResult_t ncclCommWindowDeregister(void *comm, void *win) {
    long delay = win_dereg_delay_us;
    if (delay > 0) {
        /* Collective: a peer that comes late keeps this rank waiting. */
        struct timespec d = {delay / 1000000, (delay % 1000000) * 1000};
        nanosleep(&d, NULL);
    }
    LOCKED_ENTRY(drop_reg(comm, win, 1))
}

/* ---- pre-multiplied sums -------------------------------------------------- */

EXPORT ncclResult_t ncclRedOpCreatePreMulSum(int *op, void *scalar, int datatype, int residence, void *comm) {
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    ncclResult_t r = ncclSuccess;
    if (!check_comm(c) || !op || !scalar || type_size(datatype) == 0 || (residence != 0 && residence != 1))
        r = fail(check_comm(c) ? c : NULL, ncclInvalidArgument, "fakenccl: ncclRedOpCreatePreMulSum: bad arguments");
    else {
        r = fail(c, ncclInternalError, "fakenccl: too many reduction operations");
        for (int i = 0; i < MAX_PREMUL; i++)
            if (!c->premul[i].used) {
                c->premul[i].used = 1;
                c->premul[i].dtype = datatype;
                c->premul[i].residence = residence;
                c->premul[i].value = residence == 1 ? read_scalar(scalar, datatype) : 0;
                c->premul[i].ptr = residence == 0 ? scalar : NULL;
                premul_live++;
                *op = 5 + i;
                r = ncclSuccess;
                break;
            }
    }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT ncclResult_t ncclRedOpDestroy(int op, void *comm) {
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    ncclResult_t r = ncclSuccess;
    if (!check_comm(c) || op < 5 || op - 5 >= MAX_PREMUL || !c->premul[op - 5].used)
        r = fail(check_comm(c) ? c : NULL, ncclInvalidArgument, "fakenccl: ncclRedOpDestroy: not an operation of this communicator");
    else {
        c->premul[op - 5].used = 0;
        premul_live--;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

#ifndef FAKENCCL_OLD
/* ---- all-to-all, gather, scatter ----------------------------------------- */

EXPORT ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, int datatype, void *comm,
                                 void *stream)
    COLL_ENTRY(ncclAlltoAll, OP_ALLTOALL, sendbuff, recvbuff, count, 0, 0, ;)

EXPORT ncclResult_t ncclGather(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root,
                               void *comm, void *stream)
    COLL_ENTRY(ncclGather, OP_GATHER, sendbuff, recvbuff, count, 0, root,
               if (root < 0 || root >= c->nranks) r = fail(c, ncclInvalidArgument, "fakenccl: root out of range");)

EXPORT ncclResult_t ncclScatter(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root,
                                void *comm, void *stream)
    COLL_ENTRY(ncclScatter, OP_SCATTER, sendbuff, recvbuff, count, 0, root,
               if (root < 0 || root >= c->nranks) r = fail(c, ncclInvalidArgument, "fakenccl: root out of range");)

/* ---- revoke and shrink ---------------------------------------------------- */

EXPORT ncclResult_t ncclCommRevoke(void *comm, int flags) {
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    if (!check_comm(c)) { pthread_mutex_unlock(&lock); return fail(NULL, ncclInvalidArgument, "fakenccl: invalid communicator"); }
    if (flags != 0) { pthread_mutex_unlock(&lock); return fail(c, ncclInvalidArgument, "fakenccl: revokeFlags must be 0"); }
    c->revoked = 1;
    ncclResult_t r = ncclSuccess;
    if (!c->blocking && inprogress_polls > 0) {
        c->polls_left = inprogress_polls;
        r = ncclInProgress;
    }
    struct clique *cl = c->cl;
    if (cl) {
        /* Stop this rank's in-flight work: release its streams, move nothing. */
        for (int i = 0; i < MAX_P2P; i++)
            if (cl->p2p[i].used && cl->p2p[i].comm == c) {
                hold(cl->p2p[i].stream, -1);
                cl->p2p[i].used = 0;
                c->pending--;
            }
        for (int k = 0; k < MAX_OPS; k++) {
            struct coll *op = &cl->colls[k];
            if (op->seq >= 0 && op->p[c->rank].in && op->p[c->rank].comm == c) {
                if (op->p[c->rank].held) hold(op->p[c->rank].stream, -1);
                op->p[c->rank].held = 0;
                op->p[c->rank].comm = NULL;
                op->poisoned = 1;
                c->pending--;
            }
        }
    }
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT ncclResult_t ncclCommShrink(void *comm, int *exclude, int nexclude, void **newcomm, ncclConfig_t *config,
                                   int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    ENTER();
    struct comm *c = comm;
    ncclResult_t r = ncclSuccess;
    if (!check_comm(c) || !newcomm) r = fail(NULL, ncclInvalidArgument, "fakenccl: invalid communicator");
    else if (c->dead) r = fail(c, ncclSystemError, "fakenccl: this rank was killed");
    else if (nexclude < 0 || nexclude >= c->nranks || (nexclude > 0 && !exclude))
        r = fail(c, ncclInvalidArgument, "fakenccl: bad excluded rank list");
    int below = 0;
    for (int i = 0; !r && i < nexclude; i++) {
        int e = exclude[i];
        if (e < 0 || e >= c->nranks) r = fail(c, ncclInvalidArgument, "fakenccl: excluded rank out of range");
        else if (e == c->rank) r = fail(c, ncclInvalidArgument, "fakenccl: this rank is excluded");
        for (int j = 0; !r && j < i; j++)
            if (exclude[j] == e) r = fail(c, ncclInvalidArgument, "fakenccl: excluded rank given twice");
        if (!r && e < c->rank) below++;
    }
    if (r) { pthread_mutex_unlock(&lock); return r; }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    long idx = (long)(c->cl - cliques), seq = c->shrinks++;
    memcpy(id.internal, "fakeshrk", 8);
    memcpy(id.internal + 8, &idx, sizeof idx);
    memcpy(id.internal + 16, &seq, sizeof seq);
    int blocking = c->blocking;
    if (config && config->blocking != UNDEF_INT) blocking = config->blocking != 0;
    blocking = env_blocking(blocking);
    struct comm *child = NULL;
    r = join(&child, c->nranks - nexclude, id, c->rank - below, blocking, c->dev);
    if (!r) {
        if (config) child->name = config->commName;
        *newcomm = child;
        r = finish_init(child);
    }
    pthread_mutex_unlock(&lock);
    return r;
}
#endif
