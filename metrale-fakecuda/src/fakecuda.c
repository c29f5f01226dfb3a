/*
 * fakecuda: a small, honest stand-in for the CUDA driver library, for tests on
 * machines without a GPU. It exports the driver entry points metrale uses, by
 * their real (versioned) names, and fakecuda_* control functions.
 *
 * Model:
 *  - two devices (ordinals 0 and 1), each with a primary context; the current
 *    context is per thread; resources belong to the context they were made in;
 *  - handles are real heap objects checked against a table of live handles, so
 *    an unknown or freed handle gives CUDA_ERROR_INVALID_HANDLE;
 *  - "device" memory is host memory; copies copy. A device-to-host copy queued on
 *    a stream is deferred until the stream is synchronised, queried (and idle) or
 *    destroyed, or the context synchronised: the copy engine writes later, as on a
 *    GPU. Everything else runs when it is queued;
 *  - a module image is PTX-like text: `.entry NAME(` declares a kernel (its
 *    `.param` entries give the parameter sizes), `.global ... NAME[N];` or
 *    `.global .TYPE NAME;` declares a global; an image containing "syntax error"
 *    fails to JIT with a log; an ELF or fatbin image is accepted as an empty module;
 *    a library (cuLibraryLoadData) is the same text, made per device on demand;
 *  - host functions (cuLaunchHostFunc) and stream memory operations (wait/write
 *    value, batches) are jobs of a FIFO per stream, run by a worker thread of
 *    that stream (made on first use), as the driver runs them: in order, after
 *    the work queued before them, never under the caller's call. A stream with
 *    jobs left is not idle (query says NOT_READY, synchronize waits), an event
 *    recorded after a job completes when the job has run, and a stream waiting
 *    on such an event queues a job that waits for it;
 *  - a tensor map's encoding is the arguments it was given, written into its
 *    128 bytes (see the tensor-map section), so tests can read them back;
 *  - green contexts: device 0 has 132 SMs (device 1: 66), split in groups of 8;
 *    a green context's streams belong to the device's primary context (kernels
 *    and memory of the device work on them); destroying a green context that
 *    still has streams is counted (fakecuda_green_orphans);
 *  - a launch records its configuration and the bytes of each parameter; on a
 *    capturing stream it becomes a graph node instead; replaying an executable
 *    graph records each kernel node as a launch, and a kernel node queued
 *    behind jobs of its stream runs (its code is looked up) when they have:
 *    one whose module or library was unloaded by then is counted
 *    (fakecuda_kernels_run_unloaded);
 *  - user objects: a graph (also one being captured) and each executable graph
 *    made from it hold references (an update replaces the executable's with
 *    the new graph's), and so does a replay that waits behind jobs of its
 *    stream until they ran; the destructor runs, under the lock, when the last
 *    goes (fakecuda_user_objects counts the live ones).
 *
 * Failure control (through the fakecuda_* exports): make a named call return a
 * status from its Nth call on, for K calls or for ever; switch to "shut down",
 * where every call returns CUDA_ERROR_DEINITIALIZED; override device attributes;
 * count calls by name.
 *
 * Built with -DFAKECUDA_OLD it leaves out entry points a driver before CUDA 12
 * (or 12.4) lacks, to test the missing-symbol paths.
 *
 * Not thread-safe beyond one big lock: every entry point takes it.
 */
#define _POSIX_C_SOURCE 200809L
#define _GNU_SOURCE
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <pthread.h>
#include <time.h>
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
    PEER_ACCESS_UNSUPPORTED = 217,
    INVALID_PTX = 218,
    OPERATING_SYSTEM = 304,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    PEER_ACCESS_ALREADY_ENABLED = 704,
    CONTEXT_IS_DESTROYED = 709,
    NOT_SUPPORTED = 801,
    STREAM_CAPTURE_UNSUPPORTED = 900,
    STREAM_CAPTURE_INVALIDATED = 901,
    GRAPH_EXEC_UPDATE_FAILURE = 910,
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

#define MAX_NAMES 256
struct call_slot {
    char name[64];
    long calls;
    int fail_status;  /* 0: no failure armed */
    long fail_from;   /* 1-based call number from which to fail */
    long fail_times;  /* <0: for ever */
    int pause_armed;  /* the next call waits in `enter` until resumed */
    int paused;       /* a call is waiting there now */
};
/* Signalled when a call pauses and when a paused call is resumed. */
static pthread_cond_t pause_cv = PTHREAD_COND_INITIALIZER;
static struct call_slot slots[MAX_NAMES];
static int shut_down;
static int initialised;
static int driver_version = 13000;
static int no_error_strings;
static long green_orphans; /* green contexts destroyed while streams of theirs lived */

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
    if (s->pause_armed) {
        /* A test's pause point: wait (the big lock released meanwhile, so other
         * threads' calls go on) until fakecuda_resume. */
        s->pause_armed = 0;
        s->paused = 1;
        pthread_cond_broadcast(&pause_cv);
        while (s->paused) pthread_cond_wait(&pause_cv, &lock);
    }
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

/* ---- live handles: an open-addressing table keyed by address ------------- */

enum kind {
    K_FREE = 0,
    K_MODULE,
    K_FUNC,
    K_STREAM,
    K_DEVMEM,
    K_HOSTMEM,
    K_EVENT,
    K_LIBRARY,
    K_KERNEL,
    K_POOL,
    K_GRAPH,
    K_EXEC,
    K_NODE,
    K_GREEN,
    K_DESC,
    K_PHYS,    /* cuMemCreate / import: until released and unmapped */
    K_VRANGE,  /* cuMemAddressReserve */
    K_MAPPING, /* cuMemMap: counted from the mapping table */
    K_TOMB = 99,
};
#define TABLE (1 << 16)
struct handle {
    void *p;
    enum kind kind;
    size_t bytes;
    int dev; /* owning device, -1 for none */
};
static struct handle handles[TABLE];

static size_t hash(const void *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)(x & (TABLE - 1));
}
static void track(void *p, enum kind k, size_t bytes, int dev) {
    size_t i = hash(p);
    for (size_t n = 0; n < TABLE; n++, i = (i + 1) & (TABLE - 1))
        if (handles[i].kind == K_FREE || handles[i].kind == K_TOMB) {
            handles[i] = (struct handle){p, k, bytes, dev};
            return;
        }
}
/* Handles a context reset destroyed: a real driver may crash when given one (it
 * did on CUDA 13.0 for a stream), so every use is counted. */
#define GRAVEYARD 4096
static const void *graveyard[GRAVEYARD];
static int buried;
static long stale_uses;
static int resetting; /* the reset's own bookkeeping is not a use */

static void bury(const void *p) {
    if (buried < GRAVEYARD) graveyard[buried++] = p;
}
static void note_stale(const void *p) {
    for (int i = 0; i < buried; i++)
        if (graveyard[i] == p) {
            if (!resetting) stale_uses++;
            return;
        }
}

static struct handle *find(const void *p, enum kind k) {
    if (!p) return NULL;
    size_t i = hash(p);
    for (size_t n = 0; n < TABLE; n++, i = (i + 1) & (TABLE - 1)) {
        if (handles[i].kind == K_FREE) break;
        if (handles[i].p == p && handles[i].kind == k) return &handles[i];
    }
    note_stale(p);
    return NULL;
}
static void untrack(struct handle *h) { h->kind = K_TOMB; }
static int live_mappings(void);
static int live(enum kind k) {
    if (k == K_MAPPING) return live_mappings();
    int n = 0;
    for (int i = 0; i < TABLE; i++) n += handles[i].kind == k;
    return n;
}

/* ---- devices and contexts ---------------------------------------------- */

#define MAX_DEV 2
struct ctx {
    int magic;
    int refs;
    int alive;
    unsigned long long id; /* changes each time the context is created anew */
    int dev;
    int peer[MAX_DEV];
};
static struct ctx primaries[MAX_DEV] = {
    {0x43545821, 0, 0, 1, 0, {0, 0}},
    {0x43545821, 0, 0, 1001, 1, {0, 0}},
};
static int device_count = MAX_DEV;
static __thread struct ctx *current;
static int attr_override[MAX_DEV][160];
static int attr_overridden[MAX_DEV][160];

static struct ctx *ctx_of(const void *p) {
    for (int d = 0; d < MAX_DEV; d++)
        if (p == &primaries[d]) return &primaries[d];
    return NULL;
}

/* Every call that works inside a context checks it like the real driver does. */
#define NEED_CTX()                                                                  \
    do {                                                                            \
        if (!current) return INVALID_CONTEXT;                                       \
        if (!current->alive) return CONTEXT_IS_DESTROYED;                           \
    } while (0)

/* ---- modules, functions, globals --------------------------------------- */

#define MAX_PARAMS 32
#define PARAM_BYTES 32
struct module;
struct func {
    struct module *owner;
    char name[128];
    int nparams;
    int param_size[MAX_PARAMS];
    int param_offset[MAX_PARAMS];
    int max_dynamic_shared;
    int dev;
};
struct global {
    char name[128];
    unsigned char *data;
    size_t bytes;
};
#define MAX_ITEMS 32
struct library;
struct module {
    int nfuncs, nglobals;
    struct func *funcs[MAX_ITEMS];
    struct global globals[MAX_ITEMS];
    struct library *library; /* set for a library's template */
    int dev;
};

/* `.param [.align N] .TYPE NAME[K]`: size in bytes and alignment. */
static void parse_param(const char *q, int *size, int *align) {
    int al = 0;
    if (strncmp(q, ".align ", 7) == 0) {
        al = atoi(q + 7);
        q = strchr(q + 7, ' ');
        q = q ? q + 1 : "";
    }
    /* .u64 .s32 .f32 .b8 .u8 ...: the digits give the width in bits. */
    int bits = atoi(q + 2);
    if (bits <= 0) bits = atoi(q + 1);
    if (bits <= 0) bits = 64;
    int n = 1;
    const char *end = q;
    while (*end && *end != ',' && *end != ')' && *end != '\n' && *end != '[') end++;
    if (*end == '[') n = atoi(end + 1);
    *size = bits / 8 * n;
    *align = al ? al : bits / 8;
}

static void parse_module(struct module *m, const char *text, int dev, int track_funcs) {
    const char *p = text;
    while ((p = strstr(p, ".entry ")) && m->nfuncs < MAX_ITEMS) {
        p += 7;
        struct func *f = calloc(1, sizeof *f);
        int n = 0;
        while (*p && *p != '(' && *p != ' ' && *p != '\n' && n < 127) f->name[n++] = *p++;
        f->owner = m;
        f->dev = dev;
        f->max_dynamic_shared = 48 * 1024;
        const char *open = strchr(p, '('), *close = open ? strchr(open, ')') : NULL;
        int offset = 0;
        for (const char *q = open; q && q < close && f->nparams < MAX_PARAMS;) {
            q = strstr(q, ".param ");
            if (!q || q > close) break;
            int size, align;
            parse_param(q + 7, &size, &align);
            if (align > 0) offset = (offset + align - 1) / align * align;
            f->param_offset[f->nparams] = offset;
            f->param_size[f->nparams++] = size;
            offset += size;
            q += 7;
        }
        m->funcs[m->nfuncs++] = f;
        if (track_funcs) track(f, K_FUNC, 0, dev);
    }
    p = text;
    while ((p = strstr(p, ".global ")) && m->nglobals < MAX_ITEMS) {
        const char *end = strchr(p, ';');
        if (!end) break;
        const char *br = memchr(p, '[', (size_t)(end - p));
        const char *name_end = br ? br : end;
        const char *s = name_end;
        while (s > p && s[-1] != ' ') s--;
        /* The type token is the last one starting with '.' before the name. */
        const char *t = s - 1;
        while (t > p && t[-1] != '.') t--;
        int bits = atoi(t + 1);
        if (bits <= 0) bits = atoi(t);
        struct global *g = &m->globals[m->nglobals++];
        snprintf(g->name, sizeof g->name, "%.*s", (int)(name_end - s), s);
        g->bytes = br ? (size_t)atol(br + 1) * (size_t)(bits > 0 ? bits / 8 : 1)
                      : (size_t)(bits > 0 ? bits / 8 : 4);
        g->data = calloc(1, g->bytes ? g->bytes : 1);
        p = end;
    }
}

static void free_module(struct module *m) {
    for (int i = 0; i < m->nfuncs; i++) {
        struct handle *h = find(m->funcs[i], K_FUNC);
        if (h) untrack(h);
        h = find(m->funcs[i], K_KERNEL);
        if (h) untrack(h);
        free(m->funcs[i]);
    }
    for (int i = 0; i < m->nglobals; i++) free(m->globals[i].data);
    free(m);
}

/* A library: a template module (its kernels are the CUkernel handles) and a
 * module per device, made when the device first asks for a kernel or global. */
struct library {
    struct module *tmpl;
    struct module *per_dev[MAX_DEV];
    char *text;
};

__attribute__((unused)) static struct module *library_module(struct library *l, int dev) {
    if (!l->per_dev[dev]) {
        struct module *m = calloc(1, sizeof *m);
        m->dev = dev;
        parse_module(m, l->text, dev, 1);
        l->per_dev[dev] = m;
    }
    return l->per_dev[dev];
}

/* ---- streams, events and graphs ---------------------------------------- */

struct op {
    void *dst;
    const void *src;
    size_t n;
};
#define MAX_PENDING 64
struct graph;
struct node;
#define MAX_TAILS 8
struct job;
struct stream {
    struct ctx *ctx;
    void *green; /* the green context it was made on (cuGreenCtxStreamCreate), or NULL */
    /* Jobs (host functions, memory operations) in FIFO order, run by `worker`. */
    struct job *head, *tail;
    long enq, done; /* jobs queued and run so far */
    int has_worker;
    int closing;    /* destroyed: the worker ends once the FIFO is empty */
    unsigned flags;
    int priority;
    struct op pending[MAX_PENDING];
    int npending;
    struct graph *capture;  /* the graph being captured into, or NULL */
    struct stream *origin;  /* the stream the capture began on */
    struct node *tails[MAX_TAILS];
    int ntails;
    int holds; /* work of another stand-in (fakenccl) not yet complete */
};
struct event {
    struct ctx *ctx;
    unsigned flags;
    int recorded;
    struct stream *stream; /* where it was last recorded (outside a capture) */
    struct stream *job_stream; /* the FIFO whose job `ticket` it waits for */
    long ticket;
    long stamp;
    struct graph *cap_graph;
    struct node *cap_tails[MAX_TAILS];
    int cap_ntails;
};
enum { NODE_KERNEL = 0, NODE_HOST = 3, NODE_EMPTY = 5, NODE_MEM_OP = 12, NODE_CONDITIONAL = 13 };
enum { JOB_HOST = 1, JOB_WAIT_VALUE, JOB_WRITE_VALUE, JOB_WAIT_JOB, JOB_CALLBACK, JOB_UOBJ_RELEASE,
       JOB_KERNEL };
struct job {
    int type;
    void (*fn)(void *);
    void (*callback)(void *stream, CUresult status, void *data);
    void *stream;
    void *data;
    CUdeviceptr addr;
    unsigned long long value;
    unsigned flags;
    int wide;               /* 64-bit memory operation */
    struct stream *on;      /* JOB_WAIT_JOB: the stream and ticket waited for */
    long ticket;
    struct job *next;
};
struct node {
    int type;
    struct func *f;
    unsigned grid[3], block[3], shared;
    int nparams;
    unsigned char params[MAX_PARAMS][PARAM_BYTES];
    struct graph *body;
    unsigned long long cond;
    struct job job; /* host and memory-operation nodes: what a replay queues */
};
#define MAX_NODES 256
#define MAX_EDGES 512
#define MAX_GRAPH_UOBJS 16
/* A user object: a pointer and its destructor, run when the last reference
 * (the creator's, a graph's, an executable graph's, a replay's in flight)
 * goes. Destructors run under the lock, on the releasing thread (a stream's
 * worker for a replay's references; CUDA runs them on a thread of its own;
 * CU_USER_OBJECT_NO_DESTRUCTOR_SYNC is required either way): they must
 * not call back into the driver. */
struct uobj {
    int magic;
    long refs;
    void *ptr;
    void (*destroy)(void *);
};
#define UOBJ_MAGIC 0x554f424a
static long uobjs_live;
static void uobj_release(struct uobj *u, long n) {
    u->refs -= n;
    if (u->refs > 0) return;
    u->magic = 0;
    if (u->destroy) u->destroy(u->ptr);
    free(u);
    uobjs_live--;
}
/* References a replay in flight holds: the executable's user objects and
 * the count held on each (freed with the list). */
struct uobj_ref {
    struct uobj *u;
    unsigned refs;
};
static void release_uobj_list(struct uobj_ref *list, int n) {
    for (int i = 0; i < n; i++) uobj_release(list[i].u, list[i].refs);
    free(list);
}
struct graph {
    struct ctx *ctx;
    int n;
    struct node *nodes[MAX_NODES];
    int nedges;
    struct node *from[MAX_EDGES], *to[MAX_EDGES];
    int invalid;
    int body; /* owned by a conditional node */
    /* user objects (cuGraphRetainUserObject) and the references held on each */
    struct uobj *uobj[MAX_GRAPH_UOBJS];
    unsigned uobj_refs[MAX_GRAPH_UOBJS];
    int nuobj;
};
struct gexec {
    struct ctx *ctx;
    struct graph *g;       /* a copy of the graph */
    struct node *orig[MAX_NODES]; /* the original graph's node for each copy */
};
static long event_clock;
__attribute__((unused)) static unsigned long long next_cond = 1;

static void run_pending(struct stream *s) {
    for (int i = 0; i < s->npending; i++) memcpy(s->pending[i].dst, s->pending[i].src, s->pending[i].n);
    s->npending = 0;
}

static void run_all_pending(int dev) {
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_STREAM && (dev < 0 || handles[i].dev == dev))
            run_pending(handles[i].p);
}

/* ---- the per-stream job FIFO ------------------------------------------------ */

static pthread_cond_t progress = PTHREAD_COND_INITIALIZER;
static long kernels_run_unloaded; /* fakecuda_kernels_run_unloaded */
static struct stream legacy_stream; /* jobs queued on the null stream */

static struct stream *job_stream(void *s) { return s ? (struct stream *)s : &legacy_stream; }

static int wait_met(const struct job *j) {
    unsigned long long v = j->wide ? *(volatile unsigned long long *)(uintptr_t)j->addr
                                   : *(volatile unsigned *)(uintptr_t)j->addr;
    unsigned long long want = j->wide ? j->value : (unsigned)j->value;
    switch (j->flags & 3) {
    case 0: return j->wide ? (long long)(v - want) >= 0 : (int)((unsigned)v - (unsigned)want) >= 0;
    case 1: return v == want;
    case 2: return (v & want) != 0;
    default: return j->wide ? ~(v | want) != 0 : (unsigned)~(v | want) != 0;
    }
}

static void *worker_main(void *arg) {
    struct stream *st = arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!st->head && !st->closing) pthread_cond_wait(&progress, &lock);
        struct job *j = st->head;
        if (!j) break;
        switch (j->type) {
        case JOB_HOST:
            pthread_mutex_unlock(&lock);
            j->fn(j->data);
            pthread_mutex_lock(&lock);
            break;
        case JOB_CALLBACK:
            pthread_mutex_unlock(&lock);
            j->callback(j->stream, SUCCESS, j->data);
            pthread_mutex_lock(&lock);
            break;
        case JOB_WAIT_VALUE:
            while (!wait_met(j)) {
                /* The host may write the word with no call: poll. */
                struct timespec t;
                clock_gettime(CLOCK_REALTIME, &t);
                t.tv_nsec += 50000;
                if (t.tv_nsec >= 1000000000) { t.tv_sec++; t.tv_nsec -= 1000000000; }
                pthread_cond_timedwait(&progress, &lock, &t);
            }
            break;
        case JOB_WRITE_VALUE:
            if (j->wide) *(volatile unsigned long long *)(uintptr_t)j->addr = j->value;
            else *(volatile unsigned *)(uintptr_t)j->addr = (unsigned)j->value;
            break;
        case JOB_WAIT_JOB:
            while (j->on->done < j->ticket) pthread_cond_wait(&progress, &lock);
            break;
        case JOB_KERNEL:
            /* A replayed kernel node queued behind jobs runs now: its code must
             * still be loaded (data: the function handle, never read). */
            if (!find(j->data, K_FUNC) && !find(j->data, K_KERNEL)) kernels_run_unloaded++;
            break;
        case JOB_UOBJ_RELEASE:
            /* A replay has run: the references it held go (data: a copy of
             * its executable's user objects and counts, `value` of them). */
            release_uobj_list(j->data, (int)j->value);
            break;
        }
        st->head = j->next;
        if (!st->head) st->tail = NULL;
        st->done++;
        free(j);
        pthread_cond_broadcast(&progress);
    }
    st->has_worker = 0;
    pthread_mutex_unlock(&lock);
    return NULL;
}

/* Queue a copy of `proto` on the stream's FIFO (null: the legacy stream); work
 * queued before it (deferred copies) is done first, as on a GPU. */
static CUresult enqueue(void *s, const struct job *proto) {
    struct stream *st = job_stream(s);
    if (s) run_pending(s);
    struct job *j = malloc(sizeof *j);
    if (!j) return OUT_OF_MEMORY;
    *j = *proto;
    j->next = NULL;
    if (!st->has_worker) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker_main, st)) {
            free(j);
            return OUT_OF_MEMORY;
        }
        pthread_detach(t);
        st->has_worker = 1;
    }
    if (st->tail) st->tail->next = j;
    else st->head = j;
    st->tail = j;
    st->enq++;
    pthread_cond_broadcast(&progress);
    return SUCCESS;
}

/* Wait (the lock released meanwhile) until the stream's jobs queued so far ran. */
static void drain(struct stream *st) {
    long t = st->enq;
    while (st->done < t) pthread_cond_wait(&progress, &lock);
}

/* Destroy a stream's storage: one with a worker is left to it (the worker runs
 * what is queued, as the driver does after cuStreamDestroy, and the storage is
 * kept, since waits of other streams may still read its counters). */
static void free_stream(struct stream *st) {
    if (st->has_worker || st->head) {
        st->closing = 1;
        pthread_cond_broadcast(&progress);
        return;
    }
    if (st->enq) return; /* counters may be read by other streams' waits */
    free(st);
}

/* The stream handle, checked: null is the legacy stream; others must be live and
 * of the current context. */
static CUresult stream_ok(void *s) {
    if (!s) return SUCCESS;
    if (!find(s, K_STREAM)) return INVALID_HANDLE;
    if (((struct stream *)s)->ctx != current) return INVALID_HANDLE;
    return SUCCESS;
}

static void free_graph(struct graph *g) {
    for (int i = 0; i < g->nuobj; i++) uobj_release(g->uobj[i], g->uobj_refs[i]);
    for (int i = 0; i < g->n; i++) {
        struct handle *h = find(g->nodes[i], K_NODE);
        if (h) untrack(h);
        if (g->nodes[i]->body) free_graph(g->nodes[i]->body);
        free(g->nodes[i]);
    }
    free(g);
}

static struct node *add_node(struct graph *g, struct node *proto, struct node *const *deps, int ndeps) {
    if (g->n >= MAX_NODES) return NULL;
    struct node *n = malloc(sizeof *n);
    *n = *proto;
    g->nodes[g->n++] = n;
    track(n, K_NODE, 0, g->ctx ? g->ctx->dev : -1);
    for (int i = 0; i < ndeps && g->nedges < MAX_EDGES; i++) {
        g->from[g->nedges] = deps[i];
        g->to[g->nedges++] = n;
    }
    return n;
}

/* ---- memory ranges ----------------------------------------------------- */

static int in_module(struct module *m, CUdeviceptr p, size_t n) {
    if (!m) return 0;
    for (int g = 0; g < m->nglobals; g++) {
        CUdeviceptr b = (CUdeviceptr)(uintptr_t)m->globals[g].data;
        if (p >= b && p + n <= b + m->globals[g].bytes) return 1;
    }
    return 0;
}

/* The live device range (allocation or module global) holding [p, p + n). */
static int mapped_range_ok(CUdeviceptr p, size_t n);
static int device_range_ok(CUdeviceptr p, size_t n) {
    if (mapped_range_ok(p, n)) return 1;
    for (int i = 0; i < TABLE; i++) {
        struct handle *h = &handles[i];
        if (h->kind == K_DEVMEM) {
            CUdeviceptr b = (CUdeviceptr)(uintptr_t)h->p;
            if (p >= b && p + n <= b + h->bytes) return 1;
        }
        if (h->kind == K_MODULE && in_module(h->p, p, n)) return 1;
        if (h->kind == K_LIBRARY) {
            struct library *l = h->p;
            for (int d = 0; d < MAX_DEV; d++)
                if (in_module(l->per_dev[d], p, n)) return 1;
        }
    }
    return 0;
}

static void free_vmm(enum kind k, void *p, size_t bytes);
/* Pinned host memory: zeroed, page-aligned like the driver's, and
 * deterministically never aligned to 8192, so tests of over-aligned types do not
 * depend on where the heap happens to be. */
static void *host_alloc(size_t bytes) {
    void *base = NULL;
    if (posix_memalign(&base, 8192, bytes + 4096) != 0 || !base) return NULL;
    memset(base, 0, bytes + 4096);
    return (char *)base + 4096;
}
static void host_free(void *p) { free((char *)p - 4096); }

/* Frees every resource of device `dev` (all devices for -1). */
static void free_all_handles(int dev) {
    for (int i = 0; i < TABLE; i++) {
        struct handle *h = &handles[i];
        if (h->kind == K_FREE || h->kind == K_TOMB) continue;
        if (dev >= 0 && h->dev != dev) continue;
        void *p = h->p;
        if (dev >= 0) bury(p);
        switch (h->kind) {
        case K_MODULE: untrack(h); free_module(p); break;
        case K_STREAM: untrack(h); free_stream(p); break;
        case K_EVENT: case K_DEVMEM: case K_POOL:
            untrack(h); free(p); break;
        case K_HOSTMEM: untrack(h); host_free(p); break;
        case K_GRAPH: untrack(h); free_graph(p); break;
        case K_PHYS: case K_VRANGE: untrack(h); free_vmm(h->kind, p, h->bytes); break;
        case K_EXEC: untrack(h); free_graph(((struct gexec *)p)->g); free(p); break;
        default: break;
        }
    }
}

/* ---- the last launch ---------------------------------------------------- */

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
static void *last_free_stream;
static int last_prefetch_dev = -99;
/* Stream calls want the stream's context current (an older driver's rule, not
 * driver 580's): 201 with none current, 400 with another. */
static int stream_ctx_strict;
/* cuCtxSynchronize also waits while another stand-in (fakenccl) holds a stream
 * of the device, as the driver waits for an NCCL kernel (off by default). */
static int ctx_sync_waits_holds;

/* ---- control -------------------------------------------------------------- */

EXPORT void fakecuda_reset(void) {
    pthread_mutex_lock(&lock);
    memset(slots, 0, sizeof slots);
    pthread_cond_broadcast(&pause_cv); /* a call paused there goes on */
    shut_down = 0;
    no_error_strings = 0;
    driver_version = 13000;
    device_count = MAX_DEV;
    memset(attr_overridden, 0, sizeof attr_overridden);
    memset(&last_launch, 0, sizeof last_launch);
    launches = 0;
    last_free_stream = NULL;
    last_prefetch_dev = -99;
    green_orphans = 0;
    stream_ctx_strict = 0;
    ctx_sync_waits_holds = 0;
    pthread_mutex_unlock(&lock);
}
EXPORT void fakecuda_set_ctx_sync_waits_holds(int on) {
    pthread_mutex_lock(&lock);
    ctx_sync_waits_holds = on;
    pthread_mutex_unlock(&lock);
}
EXPORT void fakecuda_set_stream_ctx_strict(int on) {
    pthread_mutex_lock(&lock);
    stream_ctx_strict = on;
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
/* Make the next call of `name` wait until fakecuda_resume(name). */
EXPORT void fakecuda_pause_next(const char *name) {
    pthread_mutex_lock(&lock);
    slot(name)->pause_armed = 1;
    pthread_mutex_unlock(&lock);
}
/* Wait up to `ms` milliseconds for a call of `name` to be paused; 1 if one is. */
EXPORT int fakecuda_wait_paused(const char *name, long ms) {
    pthread_mutex_lock(&lock);
    struct call_slot *s = slot(name);
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    while (!s->paused)
        if (pthread_cond_timedwait(&pause_cv, &lock, &t)) break;
    int paused = s->paused;
    pthread_mutex_unlock(&lock);
    return paused;
}
/* Let the paused call of `name` (if any) go on; disarm a pause not yet met. */
EXPORT void fakecuda_resume(const char *name) {
    pthread_mutex_lock(&lock);
    struct call_slot *s = slot(name);
    s->pause_armed = 0;
    s->paused = 0;
    pthread_cond_broadcast(&pause_cv);
    pthread_mutex_unlock(&lock);
}
EXPORT void fakecuda_shutdown(int on) {
    pthread_mutex_lock(&lock);
    shut_down = on;
    pthread_mutex_unlock(&lock);
}
EXPORT void fakecuda_set_driver_version(int v) { driver_version = v; }
EXPORT void fakecuda_set_error_strings(int on) { no_error_strings = !on; }
EXPORT void fakecuda_set_device_count(int n) { device_count = n < 0 ? 0 : n > MAX_DEV ? MAX_DEV : n; }
EXPORT void fakecuda_set_attribute(int dev, int attr, int value) {
    if (dev < 0 || dev >= MAX_DEV || attr < 0 || attr >= 160) return;
    attr_override[dev][attr] = value;
    attr_overridden[dev][attr] = 1;
}
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
EXPORT int fakecuda_primary_refs(void) { return primaries[0].refs + primaries[1].refs; }
EXPORT int fakecuda_device_refs(int dev) { return dev >= 0 && dev < MAX_DEV ? primaries[dev].refs : -1; }
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
EXPORT void *fakecuda_last_launch_stream(void) { return last_launch.stream; }
/* The first 8 bytes (zero-padded) of parameter i of the last launch. */
EXPORT unsigned long long fakecuda_last_param(int i) {
    unsigned long long v = 0;
    if (i >= 0 && i < MAX_PARAMS) memcpy(&v, last_launch.params[i], 8);
    return v;
}
EXPORT int fakecuda_func_max_dynamic_shared(void *f) {
    pthread_mutex_lock(&lock);
    int v = find(f, K_FUNC) ? ((struct func *)f)->max_dynamic_shared : -1;
    pthread_mutex_unlock(&lock);
    return v;
}
EXPORT int fakecuda_pending(void *s) {
    pthread_mutex_lock(&lock);
    int n = find(s, K_STREAM) ? ((struct stream *)s)->npending : -1;
    pthread_mutex_unlock(&lock);
    return n;
}
/* For the stand-in NCCL (fakenccl.c): a collective that waits for its peers
 * holds its stream, which then reads as busy (cuStreamQuery: NOT_READY;
 * synchronisation waits) until the hold is released. */
EXPORT int fakecuda_stream_hold(void *s, int delta) {
    pthread_mutex_lock(&lock);
    int r = -1;
    if (s && find(s, K_STREAM)) {
        struct stream *st = s;
        st->holds += delta;
        if (st->holds < 0) st->holds = 0;
        r = st->holds;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT int fakecuda_stream_capturing(void *s) {
    pthread_mutex_lock(&lock);
    int r = s && find(s, K_STREAM) && ((struct stream *)s)->capture != NULL;
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT int fakecuda_current_device(void) { return current ? current->dev : -1; }
/* Wait, with the lock released, while a stream is held. */
static void wait_holds(void *s) {
    while (s && find(s, K_STREAM) && ((struct stream *)s)->holds > 0) {
        pthread_mutex_unlock(&lock);
        struct timespec t = {0, 200000};
        nanosleep(&t, NULL);
        pthread_mutex_lock(&lock);
    }
}
EXPORT void *fakecuda_last_free_stream(void) { return last_free_stream; }
EXPORT int fakecuda_last_prefetch_device(void) { return last_prefetch_dev; }
EXPORT void *fakecuda_current_context(void) { return current; }
EXPORT long fakecuda_stale_uses(void) { return stale_uses; }

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
    {PEER_ACCESS_UNSUPPORTED, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {GRAPH_EXEC_UPDATE_FAILURE, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"},
    {UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_string(CUresult e, const char **s, int name) {
    if (!s) return INVALID_VALUE;
    *s = NULL;
    if (no_error_strings) return INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == e) {
            *s = name ? errors[i].name : errors[i].text;
            return SUCCESS;
        }
    return INVALID_VALUE;
}
EXPORT CUresult cuGetErrorName(CUresult e, const char **s) { return error_string(e, s, 1); }
EXPORT CUresult cuGetErrorString(CUresult e, const char **s) { return error_string(e, s, 0); }

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
    *n = device_count;
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) { LOCKED(do_count(n)); }

#define NEED_DEV(dev)                                                               \
    do {                                                                            \
        if ((dev) < 0 || (dev) >= device_count) return INVALID_DEVICE;              \
    } while (0)

static CUresult do_device_get(int *dev, int ordinal) {
    NEED_INIT();
    if (!dev) return INVALID_VALUE;
    NEED_DEV(ordinal);
    *dev = ordinal;
    return SUCCESS;
}
EXPORT CUresult cuDeviceGet(int *dev, int ordinal) { LOCKED(do_device_get(dev, ordinal)); }

static CUresult do_device_name(char *name, int len, int dev) {
    NEED_INIT();
    if (!name || len <= 0) return INVALID_VALUE;
    NEED_DEV(dev);
    snprintf(name, (size_t)len, "fakecuda stand-in device %d", dev);
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char *name, int len, int dev) {
    LOCKED(do_device_name(name, len, dev));
}

static CUresult do_uuid(unsigned char *uuid, int dev) {
    NEED_INIT();
    if (!uuid) return INVALID_VALUE;
    NEED_DEV(dev);
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xf0 + i + 16 * dev);
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid_v2(unsigned char *uuid, int dev) { LOCKED(do_uuid(uuid, dev)); }

#define TOTAL_MEMORY (80ull << 30)
static CUresult do_total_mem(size_t *bytes, int dev) {
    NEED_INIT();
    if (!bytes) return INVALID_VALUE;
    NEED_DEV(dev);
    *bytes = TOTAL_MEMORY;
    return SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) { LOCKED(do_total_mem(bytes, dev)); }

static int attribute(int dev, int a) {
    if (dev >= 0 && dev < MAX_DEV && a >= 0 && a < 160 && attr_overridden[dev][a])
        return attr_override[dev][a];
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
    case 19: return 1;           /* can map host memory */
    case 75: return 9;           /* compute capability */
    case 76: return 0;
    case 81: return 233472;      /* shared memory per multiprocessor */
    case 83: return 1;           /* managed memory */
    case 89: return 1;           /* concurrent managed access */
    case 95: return 1;           /* cooperative launch */
    case 97: return 232448;      /* shared memory per block, opt-in */
#ifndef FAKECUDA_OLD
    case 115: return 1;          /* memory pools */
#endif
    case 120: return 1;          /* cluster launch */
    case 122: return 1;          /* 64-bit stream memory operations */
    case 123: return 1;          /* stream wait value NOR */
    default: return 0;
    }
}
static CUresult do_attr(int *v, int a, int dev) {
    NEED_INIT();
    if (!v) return INVALID_VALUE;
    NEED_DEV(dev);
    if (a <= 0 || a > 200) return INVALID_VALUE;
    *v = attribute(dev, a);
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int *v, int a, int dev) { LOCKED(do_attr(v, a, dev)); }

static CUresult do_can_peer(int *can, int dev, int peer) {
    NEED_INIT();
    if (!can) return INVALID_VALUE;
    NEED_DEV(dev);
    NEED_DEV(peer);
    *can = dev != peer;
    return SUCCESS;
}
EXPORT CUresult cuDeviceCanAccessPeer(int *can, int dev, int peer) {
    LOCKED(do_can_peer(can, dev, peer));
}

static CUresult do_p2p_attr(int *v, int attr, int src, int dst) {
    NEED_INIT();
    if (!v) return INVALID_VALUE;
    NEED_DEV(src);
    NEED_DEV(dst);
    if (src == dst) return INVALID_DEVICE;
    switch (attr) {
    case 1: *v = 0; break;  /* performance rank */
    case 2: *v = 1; break;  /* access supported */
    case 3: *v = 1; break;  /* native atomics */
    case 4: *v = 1; break;  /* CUDA array access */
    default: return INVALID_VALUE;
    }
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetP2PAttribute(int *v, int attr, int src, int dst) {
    LOCKED(do_p2p_attr(v, attr, src, dst));
}

/* ---- contexts ------------------------------------------------------------ */

static CUresult do_retain(void **ctx, int dev) {
    NEED_INIT();
    if (!ctx) return INVALID_VALUE;
    NEED_DEV(dev);
    struct ctx *c = &primaries[dev];
    c->refs++;
    if (!c->alive) c->id++;
    c->alive = 1;
    *ctx = c;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { LOCKED(do_retain(ctx, dev)); }

static CUresult do_release(int dev) {
    NEED_DEV(dev);
    struct ctx *c = &primaries[dev];
    if (c->refs <= 0) return INVALID_CONTEXT;
    if (--c->refs == 0) c->alive = 0;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int dev) { LOCKED(do_release(dev)); }

/* Destroys every resource of the primary context; the retains stay, and the
 * context is created anew (with a new id) when it is next made current. */
static CUresult do_reset(int dev) {
    NEED_DEV(dev);
    resetting = 1;
    free_all_handles(dev);
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_LIBRARY) {
            struct library *l = handles[i].p;
            if (l->per_dev[dev]) {
                free_module(l->per_dev[dev]);
                l->per_dev[dev] = NULL;
            }
        }
    resetting = 0;
    primaries[dev].alive = 0;
    memset(primaries[dev].peer, 0, sizeof primaries[dev].peer);
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxReset_v2(int dev) { LOCKED(do_reset(dev)); }

static CUresult do_get_state(int dev, unsigned *flags, int *active) {
    NEED_DEV(dev);
    if (!flags || !active) return INVALID_VALUE;
    *flags = 0;
    *active = primaries[dev].alive;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active) {
    LOCKED(do_get_state(dev, flags, active));
}

#ifndef FAKECUDA_OLD
static CUresult do_ctx_id(void *ctx, unsigned long long *id) {
    if (!id) return INVALID_VALUE;
    struct ctx *c = ctx_of(ctx);
    if (!c) return INVALID_CONTEXT;
    if (!c->alive) return CONTEXT_IS_DESTROYED;
    *id = c->id;
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
    struct ctx *c = ctx_of(ctx);
    if (ctx && !c) return INVALID_CONTEXT;
    if (c && !c->alive) {
        /* A model, not a copy of the real driver: a reset primary context that is
         * still retained is created anew (with a new id) when made current. */
        if (c->refs <= 0) return CONTEXT_IS_DESTROYED;
        c->alive = 1;
        c->id++;
    }
    current = c;
    return SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(void *ctx) { LOCKED(do_set_current(ctx)); }

static CUresult do_ctx_sync(void) {
    NEED_CTX();
    run_all_pending(current->dev);
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_STREAM && handles[i].dev == current->dev)
            drain(handles[i].p);
    drain(&legacy_stream);
    if (ctx_sync_waits_holds) {
        /* Rescan after each wait: the lock is released meanwhile. */
        int again = 1;
        while (again) {
            again = 0;
            for (int i = 0; i < TABLE; i++)
                if (handles[i].kind == K_STREAM && handles[i].dev == current->dev &&
                    ((struct stream *)handles[i].p)->holds > 0) {
                    wait_holds(handles[i].p);
                    again = 1;
                    break;
                }
        }
    }
    return SUCCESS;
}
EXPORT CUresult cuCtxSynchronize(void) { LOCKED(do_ctx_sync()); }

static CUresult do_priority_range(int *least, int *greatest) {
    NEED_CTX();
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return SUCCESS;
}
EXPORT CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    LOCKED(do_priority_range(least, greatest));
}

static CUresult do_enable_peer(void *peer, unsigned flags) {
    NEED_CTX();
    struct ctx *p = ctx_of(peer);
    if (!p || flags) return INVALID_VALUE;
    if (p == current) return INVALID_DEVICE;
    if (current->peer[p->dev]) return PEER_ACCESS_ALREADY_ENABLED;
    current->peer[p->dev] = 1;
    return SUCCESS;
}
EXPORT CUresult cuCtxEnablePeerAccess(void *peer, unsigned flags) {
    LOCKED(do_enable_peer(peer, flags));
}

/* ---- streams ------------------------------------------------------------- */

static CUresult do_stream_create(void **s, unsigned flags, int priority) {
    NEED_CTX();
    if (!s) return INVALID_VALUE;
    if (priority > 0) priority = 0;
    if (priority < -5) priority = -5;
    struct stream *st = calloc(1, sizeof *st);
    st->ctx = current;
    st->flags = flags;
    st->priority = priority;
    *s = st;
    track(st, K_STREAM, 0, current->dev);
    return SUCCESS;
}
EXPORT CUresult cuStreamCreate(void **s, unsigned flags) { LOCKED(do_stream_create(s, flags, 0)); }
EXPORT CUresult cuStreamCreateWithPriority(void **s, unsigned flags, int priority) {
    LOCKED(do_stream_create(s, flags, priority));
}

static CUresult do_stream_priority(void *s, int *priority) {
    NEED_CTX();
    if (!priority) return INVALID_VALUE;
    if (!s) { *priority = 0; return SUCCESS; }
    if (!find(s, K_STREAM)) return INVALID_HANDLE;
    *priority = ((struct stream *)s)->priority;
    return SUCCESS;
}
EXPORT CUresult cuStreamGetPriority(void *s, int *priority) { LOCKED(do_stream_priority(s, priority)); }

static CUresult do_stream_destroy(void *s) {
    NEED_CTX();
    struct handle *h = find(s, K_STREAM);
    if (!h) return INVALID_HANDLE;
    run_pending(s);
    untrack(h);
    free_stream(s);
    return SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(void *s) { LOCKED(do_stream_destroy(s)); }

static CUresult invalidate_capture(struct stream *st) {
    if (st && st->capture) {
        st->capture->invalid = 1;
        return STREAM_CAPTURE_UNSUPPORTED;
    }
    return SUCCESS;
}

static CUresult do_stream_sync(void *s) {
    NEED_CTX();
    CUresult r = stream_ok(s);
    if (r) return r;
    if (s && invalidate_capture(s)) return STREAM_CAPTURE_UNSUPPORTED;
    drain(job_stream(s));
    wait_holds(s);
    if (s && find(s, K_STREAM)) run_pending(s);
    return SUCCESS;
}
EXPORT CUresult cuStreamSynchronize(void *s) { LOCKED(do_stream_sync(s)); }

static CUresult do_stream_query(void *s) {
    NEED_CTX();
    CUresult r = stream_ok(s);
    if (r) return r;
    if (s && invalidate_capture(s)) return STREAM_CAPTURE_UNSUPPORTED;
    if (job_stream(s)->done < job_stream(s)->enq) return NOT_READY;
    if (s && ((struct stream *)s)->holds > 0) return NOT_READY;
    if (s) run_pending(s);
    return SUCCESS;
}
EXPORT CUresult cuStreamQuery(void *s) { LOCKED(do_stream_query(s)); }

/* ---- events -------------------------------------------------------------- */

static CUresult do_event_create(void **e, unsigned flags) {
    NEED_CTX();
    if (!e) return INVALID_VALUE;
    struct event *ev = calloc(1, sizeof *ev);
    ev->ctx = current;
    ev->flags = flags;
    *e = ev;
    track(ev, K_EVENT, 0, current->dev);
    return SUCCESS;
}
EXPORT CUresult cuEventCreate(void **e, unsigned flags) { LOCKED(do_event_create(e, flags)); }

static CUresult do_event_destroy(void *e) {
    NEED_CTX();
    struct handle *h = find(e, K_EVENT);
    if (!h) return INVALID_HANDLE;
    untrack(h);
    free(e);
    return SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(void *e) { LOCKED(do_event_destroy(e)); }

static CUresult do_event_record(void *e, void *s) {
    NEED_CTX();
    struct event *ev = e;
    if (!find(e, K_EVENT)) return INVALID_HANDLE;
    CUresult r = stream_ok(s);
    if (r) return r;
    if (ev->ctx != current) return INVALID_HANDLE;
    struct stream *st = s;
    ev->cap_graph = NULL;
    if (st && st->capture) {
        ev->cap_graph = st->capture;
        ev->cap_ntails = st->ntails;
        memcpy(ev->cap_tails, st->tails, sizeof st->tails);
        return SUCCESS;
    }
    /* Work queued before the record (deferred copies) completes when the event
     * is waited for or queried, as on a GPU. */
    ev->stream = st;
    ev->job_stream = job_stream(st);
    ev->ticket = job_stream(st)->enq;
    ev->recorded = 1;
    ev->stamp = ++event_clock;
    return SUCCESS;
}
EXPORT CUresult cuEventRecord(void *e, void *s) { LOCKED(do_event_record(e, s)); }

static CUresult do_event_query(void *e) {
    NEED_CTX();
    struct event *ev = e;
    if (!find(e, K_EVENT)) return INVALID_HANDLE;
    if (ev->job_stream && ev->job_stream->done < ev->ticket) return NOT_READY;
    if (ev->stream && find(ev->stream, K_STREAM)) run_pending(ev->stream);
    return SUCCESS;
}
static CUresult do_event_sync(void *e) {
    NEED_CTX();
    struct event *ev = e;
    if (!find(e, K_EVENT)) return INVALID_HANDLE;
    if (ev->job_stream) {
        struct stream *js = ev->job_stream;
        long t = ev->ticket;
        while (js->done < t) pthread_cond_wait(&progress, &lock);
    }
    if (ev->stream && find(ev->stream, K_STREAM)) run_pending(ev->stream);
    return SUCCESS;
}
EXPORT CUresult cuEventQuery(void *e) { LOCKED(do_event_query(e)); }
EXPORT CUresult cuEventSynchronize(void *e) { LOCKED(do_event_sync(e)); }

static CUresult do_elapsed(float *ms, void *a, void *b) {
    NEED_CTX();
    struct event *ea = a, *eb = b;
    if (!ms) return INVALID_VALUE;
    if (!find(a, K_EVENT) || !find(b, K_EVENT)) return INVALID_HANDLE;
    if ((ea->flags & 2) || (eb->flags & 2)) return INVALID_HANDLE; /* no timing */
    if (!ea->recorded || !eb->recorded) return INVALID_HANDLE;
    *ms = (float)(eb->stamp - ea->stamp) * 0.5f;
    return SUCCESS;
}
EXPORT CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { LOCKED(do_elapsed(ms, a, b)); }

static CUresult do_stream_wait(void *s, void *e, unsigned flags) {
    NEED_CTX();
    if (flags) return INVALID_VALUE;
    if (!find(e, K_EVENT)) return INVALID_HANDLE;
    CUresult r = stream_ok(s);
    if (r) return r;
    struct stream *st = s;
    struct event *ev = e;
    if (st && ev->cap_graph) {
        if (!st->capture) {
            /* Joins the capture (fork). */
            st->capture = ev->cap_graph;
            st->origin = NULL;
            st->ntails = ev->cap_ntails;
            memcpy(st->tails, ev->cap_tails, sizeof st->tails);
        } else if (st->capture == ev->cap_graph) {
            /* Rejoins (join): depends on the event's nodes too. */
            for (int i = 0; i < ev->cap_ntails && st->ntails < MAX_TAILS; i++) {
                int seen = 0;
                for (int j = 0; j < st->ntails; j++) seen |= st->tails[j] == ev->cap_tails[i];
                if (!seen) st->tails[st->ntails++] = ev->cap_tails[i];
            }
        }
    }
    if (!ev->cap_graph && ev->job_stream && ev->job_stream != job_stream(st) &&
        ev->job_stream->done < ev->ticket && !(st && st->capture)) {
        struct job j = {.type = JOB_WAIT_JOB, .on = ev->job_stream, .ticket = ev->ticket};
        return enqueue(st, &j);
    }
    return SUCCESS;
}
EXPORT CUresult cuStreamWaitEvent(void *s, void *e, unsigned flags) {
    LOCKED(do_stream_wait(s, e, flags));
}

/* ---- modules and libraries ------------------------------------------------ */

static CUresult jit(const void *image, unsigned n, const int *opts, void **vals, int *binary) {
    const unsigned char *b = image;
    char *error_log = NULL;
    size_t error_len = 0;
    for (unsigned i = 0; i < n; i++) {
        if (opts[i] == 5) error_log = vals[i];
        if (opts[i] == 6) error_len = (size_t)(uintptr_t)vals[i];
    }
    *binary = (b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F') ||
              (b[0] == 0x50 && b[1] == 0xed && b[2] == 0x55 && b[3] == 0xba);
    if (*binary) return SUCCESS;
    const char *text = image;
    if (!(text[0] == '.' || text[0] == '/' || text[0] == ' ' || text[0] == '\n' ||
          text[0] == '\t' || (text[0] >= 'a' && text[0] <= 'z')))
        return INVALID_IMAGE;
    if (strstr(text, "syntax error")) {
        if (error_log && error_len)
            snprintf(error_log, error_len,
                     "ptxas application ptx input, line 3; error   : syntax error\n"
                     "ptxas fatal   : Ptx assembly aborted due to errors\n");
        return INVALID_PTX;
    }
    return SUCCESS;
}

static CUresult load(void **mod, const void *image, unsigned n, const int *opts, void **vals) {
    NEED_CTX();
    if (!mod || !image) return INVALID_VALUE;
    int binary;
    CUresult r = jit(image, n, opts, vals, &binary);
    if (r) return r;
    struct module *m = calloc(1, sizeof *m);
    m->dev = current->dev;
    if (!binary) parse_module(m, image, current->dev, 1);
    track(m, K_MODULE, 0, current->dev);
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
    if (current && !current->alive) return CONTEXT_IS_DESTROYED;
    untrack(h);
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

__attribute__((unused)) static CUresult global_of(struct module *m, const char *name, CUdeviceptr *p, size_t *bytes) {
    for (int i = 0; i < m->nglobals; i++)
        if (strcmp(m->globals[i].name, name) == 0) {
            if (p) *p = (CUdeviceptr)(uintptr_t)m->globals[i].data;
            if (bytes) *bytes = m->globals[i].bytes;
            return SUCCESS;
        }
    return NOT_FOUND;
}

#ifndef FAKECUDA_OLD
static CUresult do_get_global(CUdeviceptr *p, size_t *bytes, void *mod, const char *name) {
    NEED_CTX();
    if (!name) return INVALID_VALUE;
    if (!find(mod, K_MODULE)) return INVALID_HANDLE;
    return global_of(mod, name, p, bytes);
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

static CUresult do_param_info(void *f, size_t index, size_t *offset, size_t *size) {
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    struct func *fn = f;
    if (index >= (size_t)fn->nparams) return INVALID_VALUE;
    if (offset) *offset = (size_t)fn->param_offset[index];
    if (size) *size = (size_t)fn->param_size[index];
    return SUCCESS;
}
EXPORT CUresult cuFuncGetParamInfo(void *f, size_t index, size_t *offset, size_t *size) {
    LOCKED(do_param_info(f, index, offset, size));
}

/* Libraries (CUDA 12.0+). */
static CUresult do_library_load(void **lib, const void *image, int *opts, void **vals,
                                unsigned n) {
    NEED_INIT();
    if (!lib || !image) return INVALID_VALUE;
    int binary;
    CUresult r = jit(image, n, opts, vals, &binary);
    if (r) return r;
    struct library *l = calloc(1, sizeof *l);
    l->tmpl = calloc(1, sizeof *l->tmpl);
    l->tmpl->library = l;
    const char *text = binary ? "" : image;
    size_t len = strlen(text);
    l->text = malloc(len + 1);
    memcpy(l->text, text, len + 1);
    parse_module(l->tmpl, l->text, -1, 0);
    for (int i = 0; i < l->tmpl->nfuncs; i++) track(l->tmpl->funcs[i], K_KERNEL, 0, -1);
    track(l, K_LIBRARY, 0, -1);
    *lib = l;
    return SUCCESS;
}
EXPORT CUresult cuLibraryLoadData(void **lib, const void *image, int *opts, void **vals,
                                  unsigned n, void *lopts, void **lvals, unsigned ln) {
    (void)lopts;
    (void)lvals;
    (void)ln;
    LOCKED(do_library_load(lib, image, opts, vals, n));
}

static CUresult do_library_unload(void *lib) {
    struct handle *h = find(lib, K_LIBRARY);
    if (!h) return INVALID_HANDLE;
    struct library *l = lib;
    untrack(h);
    for (int d = 0; d < MAX_DEV; d++)
        if (l->per_dev[d]) free_module(l->per_dev[d]);
    free_module(l->tmpl);
    free(l->text);
    free(l);
    return SUCCESS;
}
EXPORT CUresult cuLibraryUnload(void *lib) { LOCKED(do_library_unload(lib)); }

static CUresult do_library_kernel(void **kernel, void *lib, const char *name) {
    if (!kernel || !name) return INVALID_VALUE;
    if (!find(lib, K_LIBRARY)) return INVALID_HANDLE;
    struct module *m = ((struct library *)lib)->tmpl;
    for (int i = 0; i < m->nfuncs; i++)
        if (strcmp(m->funcs[i]->name, name) == 0) {
            *kernel = m->funcs[i];
            return SUCCESS;
        }
    return NOT_FOUND;
}
EXPORT CUresult cuLibraryGetKernel(void **kernel, void *lib, const char *name) {
    LOCKED(do_library_kernel(kernel, lib, name));
}

static CUresult do_kernel_function(void **f, void *kernel) {
    NEED_CTX();
    if (!f) return INVALID_VALUE;
    if (!find(kernel, K_KERNEL)) return INVALID_HANDLE;
    struct func *k = kernel;
    struct module *m = library_module(k->owner->library, current->dev);
    for (int i = 0; i < m->nfuncs; i++)
        if (strcmp(m->funcs[i]->name, k->name) == 0) {
            *f = m->funcs[i];
            return SUCCESS;
        }
    return NOT_FOUND;
}
EXPORT CUresult cuKernelGetFunction(void **f, void *kernel) { LOCKED(do_kernel_function(f, kernel)); }

static CUresult do_library_global(CUdeviceptr *p, size_t *bytes, void *lib, const char *name) {
    NEED_CTX();
    if (!name) return INVALID_VALUE;
    if (!find(lib, K_LIBRARY)) return INVALID_HANDLE;
    return global_of(library_module(lib, current->dev), name, p, bytes);
}
EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *p, size_t *bytes, void *lib, const char *name) {
    LOCKED(do_library_global(p, bytes, lib, name));
}

static CUresult do_kernel_count(unsigned *n, void *lib) {
    if (!n) return INVALID_VALUE;
    if (!find(lib, K_LIBRARY)) return INVALID_HANDLE;
    *n = (unsigned)((struct library *)lib)->tmpl->nfuncs;
    return SUCCESS;
}
EXPORT CUresult cuLibraryGetKernelCount(unsigned *n, void *lib) { LOCKED(do_kernel_count(n, lib)); }

static CUresult do_enumerate_kernels(void **ks, unsigned n, void *lib) {
    if (!ks) return INVALID_VALUE;
    if (!find(lib, K_LIBRARY)) return INVALID_HANDLE;
    struct module *m = ((struct library *)lib)->tmpl;
    if (n != (unsigned)m->nfuncs) return INVALID_VALUE;
    for (int i = 0; i < m->nfuncs; i++) ks[i] = m->funcs[i];
    return SUCCESS;
}
EXPORT CUresult cuLibraryEnumerateKernels(void **ks, unsigned n, void *lib) {
    LOCKED(do_enumerate_kernels(ks, n, lib));
}

static CUresult do_kernel_name(const char **name, void *k) {
    if (!name) return INVALID_VALUE;
    if (!find(k, K_KERNEL)) return INVALID_HANDLE;
    *name = ((struct func *)k)->name;
    return SUCCESS;
}
EXPORT CUresult cuKernelGetName(const char **name, void *k) { LOCKED(do_kernel_name(name, k)); }
#endif

/* ---- function attributes ------------------------------------------------- */

static CUresult do_func_set(void *f, int attr, int value) {
    NEED_CTX();
    struct handle *h = find(f, K_FUNC);
    if (!h) return INVALID_HANDLE;
    if (attr == 8) {
        if (value < 0 || value > attribute(current->dev, 97)) return INVALID_VALUE;
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

static CUresult check_launch(struct func *fn, const unsigned *grid, const unsigned *block,
                             unsigned shared, void **params) {
    for (int i = 0; i < 3; i++)
        if (!grid[i] || !block[i]) return INVALID_VALUE;
    if ((unsigned long long)block[0] * block[1] * block[2] > 1024) return INVALID_VALUE;
    if (block[2] > 64) return INVALID_VALUE;
    if (shared > (unsigned)fn->max_dynamic_shared) return INVALID_VALUE;
    if (fn->nparams && !params) return INVALID_VALUE;
    if (fn->dev != current->dev) return INVALID_HANDLE;
    return SUCCESS;
}

static void record(struct func *fn, const unsigned *grid, const unsigned *block, unsigned shared,
                   void *stream, int nparams, unsigned char params[][PARAM_BYTES]) {
    snprintf(last_launch.kernel, sizeof last_launch.kernel, "%s", fn->name);
    memcpy(last_launch.grid, grid, sizeof last_launch.grid);
    memcpy(last_launch.block, block, sizeof last_launch.block);
    last_launch.shared = shared;
    last_launch.stream = stream;
    last_launch.nparams = nparams;
    memset(last_launch.params, 0, sizeof last_launch.params);
    for (int i = 0; i < nparams; i++) memcpy(last_launch.params[i], params[i], 8);
    memset(last_launch.cluster, 0, sizeof last_launch.cluster);
    last_launch.cooperative = 0;
    launches++;
}

/* A node holding fn's launch, its parameter bytes copied out of `params`. */
static void fill_node(struct node *n, struct func *fn, const unsigned *grid,
                      const unsigned *block, unsigned shared, void **params) {
    memset(n, 0, sizeof *n);
    n->type = NODE_KERNEL;
    n->f = fn;
    memcpy(n->grid, grid, sizeof n->grid);
    memcpy(n->block, block, sizeof n->block);
    n->shared = shared;
    n->nparams = fn->nparams;
    for (int i = 0; i < fn->nparams; i++) {
        int size = fn->param_size[i] > PARAM_BYTES ? PARAM_BYTES : fn->param_size[i];
        memcpy(n->params[i], params[i], (size_t)size);
    }
}

static CUresult launch_on(struct func *fn, const unsigned *grid, const unsigned *block,
                          unsigned shared, void *stream, void **params) {
    CUresult r = check_launch(fn, grid, block, shared, params);
    if (r) return r;
    if ((r = stream_ok(stream))) return r;
    struct node n;
    fill_node(&n, fn, grid, block, shared, params);
    struct stream *st = stream;
    if (st && st->capture) {
        struct node *added = add_node(st->capture, &n, st->tails, st->ntails);
        if (!added) return OUT_OF_MEMORY;
        st->tails[0] = added;
        st->ntails = 1;
        return SUCCESS;
    }
    record(fn, grid, block, shared, stream, n.nparams, n.params);
    return SUCCESS;
}

static CUresult do_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned shared, void *stream,
                          void **params, void **extra) {
    NEED_CTX();
    (void)extra;
    if (!find(f, K_FUNC)) return INVALID_HANDLE;
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return launch_on(f, grid, block, shared, stream, params);
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
    CUresult r = launch_on(f, c->grid, c->block, c->shared, c->stream, params);
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

static CUresult alloc_device(CUdeviceptr *p, size_t bytes) {
    if (!p || !bytes) return INVALID_VALUE;
    if (bytes > TOTAL_MEMORY) return OUT_OF_MEMORY;
    /* 256-byte aligned, as the driver's allocations are. */
    void *m = NULL;
    if (posix_memalign(&m, 256, bytes) != 0 || !m) return OUT_OF_MEMORY;
    track(m, K_DEVMEM, bytes, current->dev);
    *p = (CUdeviceptr)(uintptr_t)m;
    return SUCCESS;
}

static CUresult do_alloc(CUdeviceptr *p, size_t bytes) {
    NEED_CTX();
    return alloc_device(p, bytes);
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) { LOCKED(do_alloc(p, bytes)); }

static int release_pool_import(CUdeviceptr p);
static CUresult free_device(CUdeviceptr p) {
    if (release_pool_import(p)) return SUCCESS; /* the importer's reference only */
    struct handle *h = find((void *)(uintptr_t)p, K_DEVMEM);
    if (!h) return INVALID_VALUE;
    untrack(h);
    free((void *)(uintptr_t)p);
    return SUCCESS;
}
static CUresult do_free(CUdeviceptr p) {
    NEED_CTX();
    run_all_pending(current->dev);
    return free_device(p);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { LOCKED(do_free(p)); }

static CUresult do_alloc_managed(CUdeviceptr *p, size_t bytes, unsigned flags) {
    NEED_CTX();
    if (flags != 1 && flags != 2) return INVALID_VALUE;
    return alloc_device(p, bytes);
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned flags) {
    LOCKED(do_alloc_managed(p, bytes, flags));
}

static CUresult do_mem_info(size_t *free_bytes, size_t *total) {
    NEED_CTX();
    size_t used = 0;
    for (int i = 0; i < TABLE; i++)
        if ((handles[i].kind == K_DEVMEM || handles[i].kind == K_PHYS) && handles[i].dev == current->dev)
            used += handles[i].bytes;
    if (free_bytes) *free_bytes = TOTAL_MEMORY - used;
    if (total) *total = TOTAL_MEMORY;
    return SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    LOCKED(do_mem_info(free_bytes, total));
}

/* The device allocation containing `a` (a linear scan: tests only). */
static struct handle *containing(CUdeviceptr a) {
    if (!a) return NULL;
    for (int i = 0; i < TABLE; i++) {
        struct handle *h = &handles[i];
        if (h->kind != K_DEVMEM) continue;
        CUdeviceptr base = (CUdeviceptr)(uintptr_t)h->p;
        if (base <= a && a < base + h->bytes) return h;
    }
    return NULL;
}

/* cuPointerGetAttribute: the memory type (2, device) and device ordinal (9) of
 * device allocations; anything else is not memory the stand-in knows. */
static CUresult do_pointer_attr(void *data, int attr, CUdeviceptr p) {
    NEED_INIT();
    if (!data) return INVALID_VALUE;
    struct handle *h = containing(p);
    if (!h) return INVALID_VALUE;
    switch (attr) {
    case 2: *(unsigned *)data = 2; return SUCCESS;
    case 9: *(int *)data = h->dev; return SUCCESS;
    default: return NOT_SUPPORTED;
    }
}
EXPORT CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    LOCKED(do_pointer_attr(data, attr, p));
}

static CUresult do_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    NEED_CTX();
    struct handle *h = containing(p);
    if (!h) return NOT_FOUND;
    if (base) *base = (CUdeviceptr)(uintptr_t)h->p;
    if (size) *size = h->bytes;
    return SUCCESS;
}
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    LOCKED(do_address_range(base, size, p));
}

static CUresult do_alloc_host(void **p, size_t bytes) {
    NEED_CTX();
    if (!p || !bytes) return INVALID_VALUE;
    *p = host_alloc(bytes);
    if (!*p) return OUT_OF_MEMORY;
    track(*p, K_HOSTMEM, bytes, current->dev);
    return SUCCESS;
}
EXPORT CUresult cuMemAllocHost_v2(void **p, size_t bytes) { LOCKED(do_alloc_host(p, bytes)); }

static CUresult do_free_host(void *p) {
    NEED_CTX();
    struct handle *h = find(p, K_HOSTMEM);
    if (!h) return INVALID_VALUE;
    /* The driver's cuMemFreeHost waits for the context's work, as
     * cuCtxSynchronize does (a stream blocked on an unmet wait blocks it). */
    run_all_pending(current->dev);
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_STREAM && handles[i].dev == current->dev)
            drain(handles[i].p);
    drain(&legacy_stream);
    untrack(h);
    host_free(p);
    return SUCCESS;
}
EXPORT CUresult cuMemFreeHost(void *p) { LOCKED(do_free_host(p)); }

/* ---- legacy IPC ------------------------------------------------------------
 * A handle names an allocation or an event of this process (the stand-in's device
 * memory is plain heap memory, so it cannot be opened in another process);
 * opening in the same process gives the same address / a new event handle, and
 * opens are counted until closed. */
struct ipc_bytes { uint64_t magic, pid, ptr, bytes; char pad[32]; };
#define IPC_MEM_MAGIC 0x6d65747261697063ULL
#define IPC_EVENT_MAGIC 0x6d65747261657674ULL
#define MAX_IPC_OPEN 256
static CUdeviceptr ipc_open[MAX_IPC_OPEN];
static CUdeviceptr pool_imports[MAX_IPC_OPEN];
static int release_pool_import(CUdeviceptr p) {
    for (int i = 0; i < MAX_IPC_OPEN; i++)
        if (p && pool_imports[i] == p) {
            pool_imports[i] = 0;
            return 1;
        }
    return 0;
}
static int ipc_open_count(void) {
    int n = 0;
    for (int i = 0; i < MAX_IPC_OPEN; i++) n += (ipc_open[i] != 0) + (pool_imports[i] != 0);
    return n;
}
EXPORT int fakecuda_ipc_open_count(void) {
    pthread_mutex_lock(&lock);
    int n = ipc_open_count();
    pthread_mutex_unlock(&lock);
    return n;
}

static CUresult do_ipc_get_mem(struct ipc_bytes *h, CUdeviceptr p) {
    NEED_CTX();
    if (!h) return INVALID_VALUE;
    struct handle *d = find((void *)(uintptr_t)p, K_DEVMEM);
    if (!d) return INVALID_VALUE;
    *h = (struct ipc_bytes){IPC_MEM_MAGIC, (uint64_t)getpid(), p, d->bytes, {0}};
    return SUCCESS;
}
EXPORT CUresult cuIpcGetMemHandle(void *h, CUdeviceptr p) { LOCKED(do_ipc_get_mem(h, p)); }

static CUresult do_ipc_open_mem(CUdeviceptr *p, struct ipc_bytes h, unsigned flags) {
    NEED_CTX();
    if (!p || flags > 1 || h.magic != IPC_MEM_MAGIC) return INVALID_VALUE;
    if (h.pid != (uint64_t)getpid() || !find((void *)(uintptr_t)h.ptr, K_DEVMEM)) return INVALID_VALUE;
    for (int i = 0; i < MAX_IPC_OPEN; i++)
        if (!ipc_open[i]) {
            ipc_open[i] = h.ptr;
            *p = h.ptr;
            return SUCCESS;
        }
    return OUT_OF_MEMORY;
}
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, struct ipc_bytes h, unsigned flags) {
    LOCKED(do_ipc_open_mem(p, h, flags));
}

static CUresult do_ipc_close_mem(CUdeviceptr p) {
    NEED_CTX();
    for (int i = 0; i < MAX_IPC_OPEN; i++)
        if (ipc_open[i] == p && p) {
            ipc_open[i] = 0;
            return SUCCESS;
        }
    return INVALID_VALUE;
}
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) { LOCKED(do_ipc_close_mem(p)); }

static CUresult do_ipc_get_event(struct ipc_bytes *h, void *e) {
    NEED_CTX();
    if (!h) return INVALID_VALUE;
    struct event *ev = e;
    if (!find(e, K_EVENT)) return INVALID_HANDLE;
    if (!(ev->flags & 4) || !(ev->flags & 2)) return INVALID_VALUE; /* interprocess, no timing */
    *h = (struct ipc_bytes){IPC_EVENT_MAGIC, (uint64_t)getpid(), (uint64_t)(uintptr_t)e, 0, {0}};
    return SUCCESS;
}
EXPORT CUresult cuIpcGetEventHandle(void *h, void *e) { LOCKED(do_ipc_get_event(h, e)); }

static CUresult do_ipc_open_event(void **e, struct ipc_bytes h) {
    NEED_CTX();
    if (!e || h.magic != IPC_EVENT_MAGIC || h.pid != (uint64_t)getpid()) return INVALID_VALUE;
    if (!find((void *)(uintptr_t)h.ptr, K_EVENT)) return INVALID_VALUE;
    return do_event_create(e, 4 | 2);
}
EXPORT CUresult cuIpcOpenEventHandle(void **e, struct ipc_bytes h) { LOCKED(do_ipc_open_event(e, h)); }

/* ---- virtual memory management -------------------------------------------
 * Physical memory is a memfd (so an exported descriptor is a real one another
 * process can map); a reserved range is PROT_NONE address space; a mapping maps
 * the memfd at its address with MAP_FIXED, and unmapping puts PROT_NONE back.
 * Copies reach mapped memory only where every byte is mapped with access set.
 * cuMemUnmap does not wait for queued work here (the runtime must order it). */

#define VMM_GRANULARITY ((size_t)2 << 20)
struct phys {
    int fd;
    size_t size;
    int dev;
    unsigned handle_types;
    int released; /* cuMemRelease was called */
    int mapped;   /* live mappings of it */
};
#define MAX_MAPPINGS 4096
static struct mapping {
    int used;
    CUdeviceptr addr;
    size_t size;
    struct phys *ph;
    unsigned access; /* bit d: device d may access */
} maps[MAX_MAPPINGS];

static int live_mappings(void) {
    int n = 0;
    for (int i = 0; i < MAX_MAPPINGS; i++) n += maps[i].used;
    return n;
}
static int mapped_range_ok(CUdeviceptr p, size_t n) {
    CUdeviceptr at = p, end = p + n;
    while (at < end) {
        int found = 0;
        for (int i = 0; i < MAX_MAPPINGS; i++)
            if (maps[i].used && maps[i].access && at >= maps[i].addr && at < maps[i].addr + maps[i].size) {
                at = maps[i].addr + maps[i].size;
                found = 1;
                break;
            }
        if (!found) return 0;
    }
    return n > 0;
}
static void phys_maybe_free(struct phys *ph) {
    if (!ph->released || ph->mapped) return;
    struct handle *h = find(ph, K_PHYS);
    if (h) untrack(h);
    close(ph->fd);
    free(ph);
}
static void free_vmm(enum kind k, void *p, size_t bytes) {
    if (k == K_PHYS) {
        struct phys *ph = p;
        for (int i = 0; i < MAX_MAPPINGS; i++)
            if (maps[i].used && maps[i].ph == ph) maps[i].used = 0;
        close(ph->fd);
        free(ph);
    } else {
        CUdeviceptr b = (CUdeviceptr)(uintptr_t)p;
        for (int i = 0; i < MAX_MAPPINGS; i++)
            if (maps[i].used && maps[i].addr >= b && maps[i].addr < b + bytes) maps[i].used = 0;
        munmap(p, bytes);
    }
}

struct alloc_prop { int type; unsigned handle_types; int loc_type; int loc_id; };
static CUresult prop_ok(const struct alloc_prop *prop) {
    if (!prop || prop->type != 1 || prop->loc_type != 1) return INVALID_VALUE;
    if (prop->loc_id < 0 || prop->loc_id >= device_count) return INVALID_DEVICE;
    if (prop->handle_types & ~1u) return NOT_SUPPORTED;
    return SUCCESS;
}

static CUresult do_granularity(size_t *g, const struct alloc_prop *prop, int option) {
    if (!g || (option != 0 && option != 1)) return INVALID_VALUE;
    CUresult r = prop_ok(prop);
    if (r) return r;
    *g = VMM_GRANULARITY;
    return SUCCESS;
}
EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    LOCKED(do_granularity(g, prop, option));
}

static struct phys *new_phys(int fd, size_t size, int dev, unsigned types) {
    struct phys *ph = calloc(1, sizeof *ph);
    if (!ph) return NULL;
    ph->fd = fd;
    ph->size = size;
    ph->dev = dev;
    ph->handle_types = types;
    track(ph, K_PHYS, size, dev);
    return ph;
}
static CUresult do_mem_create(unsigned long long *handle, size_t size, const struct alloc_prop *prop,
                              unsigned long long flags) {
    NEED_CTX();
    if (!handle || flags) return INVALID_VALUE;
    CUresult r = prop_ok(prop);
    if (r) return r;
    if (!size || size % VMM_GRANULARITY) return INVALID_VALUE;
    if (size > TOTAL_MEMORY) return OUT_OF_MEMORY;
    /* The device is in the name, so an importer (in any process) finds where the
     * memory lives, as the real driver knows. */
    char name[32];
    snprintf(name, sizeof name, "fakecuda-vmm-dev%d", prop->loc_id);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) { close(fd); return OUT_OF_MEMORY; }
    struct phys *ph = new_phys(fd, size, prop->loc_id, prop->handle_types);
    if (!ph) { close(fd); return OUT_OF_MEMORY; }
    *handle = (unsigned long long)(uintptr_t)ph;
    return SUCCESS;
}
EXPORT CUresult cuMemCreate(unsigned long long *handle, size_t size, const void *prop, unsigned long long flags) {
    LOCKED(do_mem_create(handle, size, prop, flags));
}

static CUresult do_mem_release(unsigned long long handle) {
    struct phys *ph = (struct phys *)(uintptr_t)handle;
    if (!find(ph, K_PHYS) || ph->released) return INVALID_VALUE;
    ph->released = 1;
    phys_maybe_free(ph);
    return SUCCESS;
}
EXPORT CUresult cuMemRelease(unsigned long long handle) { LOCKED(do_mem_release(handle)); }

static CUresult do_reserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    NEED_CTX();
    if (!p || flags || !size || size % VMM_GRANULARITY) return INVALID_VALUE;
    if (align == 0) align = VMM_GRANULARITY;
    if (align & (align - 1)) return INVALID_VALUE;
    (void)addr; /* a hint */
    size_t total = size + align;
    char *m = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
    if (base > (uintptr_t)m) munmap(m, base - (uintptr_t)m);
    uintptr_t tail = (uintptr_t)m + total, end = base + size;
    if (tail > end) munmap((void *)end, tail - end);
    track((void *)base, K_VRANGE, size, current->dev);
    *p = (CUdeviceptr)base;
    return SUCCESS;
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
    LOCKED(do_reserve(p, size, align, addr, flags));
}

static struct handle *range_of(CUdeviceptr p, size_t n) {
    for (int i = 0; i < TABLE; i++) {
        struct handle *h = &handles[i];
        CUdeviceptr b = (CUdeviceptr)(uintptr_t)h->p;
        if (h->kind == K_VRANGE && p >= b && p + n <= b + h->bytes && p + n > p) return h;
    }
    return NULL;
}
static CUresult do_address_free(CUdeviceptr p, size_t size) {
    struct handle *h = find((void *)(uintptr_t)p, K_VRANGE);
    if (!h || h->bytes != size) return INVALID_VALUE;
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (maps[i].used && maps[i].addr >= p && maps[i].addr < p + size) return INVALID_VALUE; /* still mapped */
    untrack(h);
    munmap((void *)(uintptr_t)p, size);
    return SUCCESS;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { LOCKED(do_address_free(p, size)); }

static CUresult do_map(CUdeviceptr p, size_t size, size_t offset, unsigned long long handle,
                       unsigned long long flags) {
    NEED_CTX();
    struct phys *ph = (struct phys *)(uintptr_t)handle;
    if (flags || !size || size % VMM_GRANULARITY || p % VMM_GRANULARITY || offset % VMM_GRANULARITY)
        return INVALID_VALUE;
    if (!find(ph, K_PHYS) || ph->released) return INVALID_HANDLE;
    if (offset > ph->size || size > ph->size - offset) return INVALID_VALUE;
    if (!range_of(p, size)) return INVALID_VALUE;
    int slot_i = -1;
    for (int i = 0; i < MAX_MAPPINGS; i++) {
        if (maps[i].used && p < maps[i].addr + maps[i].size && maps[i].addr < p + size)
            return INVALID_VALUE; /* over a mapping */
        if (!maps[i].used && slot_i < 0) slot_i = i;
    }
    if (slot_i < 0) return OUT_OF_MEMORY;
    void *m = mmap((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, ph->fd, (off_t)offset);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    maps[slot_i] = (struct mapping){1, p, size, ph, 0};
    ph->mapped++;
    return SUCCESS;
}
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, unsigned long long handle,
                         unsigned long long flags) {
    LOCKED(do_map(p, size, offset, handle, flags));
}

static CUresult do_unmap(CUdeviceptr p, size_t size) {
    int i;
    for (i = 0; i < MAX_MAPPINGS; i++)
        if (maps[i].used && maps[i].addr == p && maps[i].size == size) break;
    if (i == MAX_MAPPINGS) return INVALID_VALUE;
    mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    maps[i].used = 0;
    maps[i].ph->mapped--;
    phys_maybe_free(maps[i].ph);
    return SUCCESS;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t size) { LOCKED(do_unmap(p, size)); }

struct access_desc { int loc_type; int loc_id; int flags; };
static CUresult do_set_access(CUdeviceptr p, size_t size, const struct access_desc *desc, size_t count) {
    NEED_CTX();
    if (!desc || !count) return INVALID_VALUE;
    /* every byte must be mapped */
    CUdeviceptr at = p, end = p + size;
    while (at < end) {
        int found = 0;
        for (int i = 0; i < MAX_MAPPINGS; i++)
            if (maps[i].used && at >= maps[i].addr && at < maps[i].addr + maps[i].size) {
                at = maps[i].addr + maps[i].size;
                found = 1;
                break;
            }
        if (!found) return INVALID_VALUE;
    }
    unsigned set = 0, clear = 0;
    for (size_t k = 0; k < count; k++) {
        if (desc[k].loc_type != 1) return INVALID_VALUE;
        if (desc[k].loc_id < 0 || desc[k].loc_id >= device_count) return INVALID_DEVICE;
        if (desc[k].flags == 3 || desc[k].flags == 1) set |= 1u << desc[k].loc_id;
        else if (desc[k].flags == 0) clear |= 1u << desc[k].loc_id;
        else return INVALID_VALUE;
    }
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (maps[i].used && maps[i].addr >= p && maps[i].addr < end)
            maps[i].access = (maps[i].access | set) & ~clear;
    return SUCCESS;
}
EXPORT CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const void *desc, size_t count) {
    LOCKED(do_set_access(p, size, desc, count));
}

static CUresult do_export(void *out, unsigned long long handle, int type, unsigned long long flags) {
    struct phys *ph = (struct phys *)(uintptr_t)handle;
    if (!out || flags) return INVALID_VALUE;
    if (!find(ph, K_PHYS) || ph->released) return INVALID_HANDLE;
    if (type != 1 || !(ph->handle_types & 1u)) return INVALID_VALUE;
    int fd = dup(ph->fd);
    if (fd < 0) return OUT_OF_MEMORY;
    *(int *)out = fd;
    return SUCCESS;
}
EXPORT CUresult cuMemExportToShareableHandle(void *out, unsigned long long handle, int type,
                                             unsigned long long flags) {
    LOCKED(do_export(out, handle, type, flags));
}

static CUresult do_import(unsigned long long *handle, void *os_handle, int type) {
    NEED_CTX();
    if (!handle || type != 1) return INVALID_VALUE;
    int fd = (int)(intptr_t)os_handle;
    struct stat st;
    /* Not a descriptor of memory (a pipe, /dev/null): the driver says UNKNOWN. */
    if (fstat(fd, &st) != 0 || st.st_size <= 0) return UNKNOWN;
    if ((size_t)st.st_size % VMM_GRANULARITY) return INVALID_VALUE;
    /* The memory lives on the exporter's device (read from the memfd's name);
     * another file is taken as the importer's. */
    int dev = current->dev;
    char link[64], target[256];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t tn = readlink(link, target, sizeof target - 1);
    if (tn > 0) {
        target[tn] = 0;
        const char *at = strstr(target, "fakecuda-vmm-dev");
        if (at) dev = atoi(at + strlen("fakecuda-vmm-dev"));
    }
    int mine = dup(fd);
    if (mine < 0) return OUT_OF_MEMORY;
    struct phys *ph = new_phys(mine, (size_t)st.st_size, dev, 1);
    if (!ph) { close(mine); return OUT_OF_MEMORY; }
    *handle = (unsigned long long)(uintptr_t)ph;
    return SUCCESS;
}
EXPORT CUresult cuMemImportFromShareableHandle(unsigned long long *handle, void *os_handle, int type) {
    LOCKED(do_import(handle, os_handle, type));
}

/* The leading fields of CUmemAllocationProp: pinned device memory, its handle
 * types, located on its device. The rest is left as the caller set it. */
static CUresult do_props_from_handle(struct alloc_prop *prop, unsigned long long handle) {
    struct phys *ph = (struct phys *)(uintptr_t)handle;
    if (!prop) return INVALID_VALUE;
    if (!find(ph, K_PHYS) || ph->released) return INVALID_VALUE;
    prop->type = 1;
    prop->handle_types = ph->handle_types;
    prop->loc_type = 1;
    prop->loc_id = ph->dev;
    return SUCCESS;
}
EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(void *prop, unsigned long long handle) {
    LOCKED(do_props_from_handle(prop, handle));
}

/* Queued work on a capturing stream would become a graph node; the stand-in
 * models only kernel nodes, so other work invalidates the capture. */
#define NO_CAPTURE(s)                                                               \
    do {                                                                            \
        if ((s) && ((struct stream *)(s))->capture) {                               \
            ((struct stream *)(s))->capture->invalid = 1;                           \
            return STREAM_CAPTURE_UNSUPPORTED;                                      \
        }                                                                           \
    } while (0)

static CUresult do_htod(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    NEED_CTX();
    CUresult r = stream_ok(stream);
    if (r) return r;
    NO_CAPTURE(stream);
    if (!src || !device_range_ok(dst, n)) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return SUCCESS;
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    LOCKED(do_htod(dst, src, n, stream));
}

static CUresult do_dtoh(void *dst, CUdeviceptr src, size_t n, void *stream) {
    NEED_CTX();
    CUresult r = stream_ok(stream);
    if (r) return r;
    NO_CAPTURE(stream);
    if (!dst || !device_range_ok(src, n)) return INVALID_VALUE;
    struct stream *st = stream;
    if (st && st->npending < MAX_PENDING) {
        /* The copy engine writes the host memory later. */
        st->pending[st->npending++] = (struct op){dst, (const void *)(uintptr_t)src, n};
        return SUCCESS;
    }
    memcpy(dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    LOCKED(do_dtoh(dst, src, n, stream));
}

#ifndef FAKECUDA_OLD
/* cuMemcpyBatchAsync_v2 (CUDA 12.8+; absent from the old build): each pair in
 * order, device ends checked, a device-to-host write left pending as
 * cuMemcpyDtoHAsync's is. The legacy stream is refused, as the driver does;
 * the attributes must start at index 0 and name a source access order. */
struct batch_attrs { int order; int src_type, src_id, dst_type, dst_id; unsigned flags; };
static CUresult do_copy_batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                         struct batch_attrs *attrs, size_t *idxs, size_t nattrs, void *stream) {
    NEED_CTX();
    if (!stream) return INVALID_VALUE;
    CUresult r = stream_ok(stream);
    if (r) return r;
    NO_CAPTURE(stream);
    if (!count || !dsts || !srcs || !sizes || !attrs || !idxs || !nattrs) return INVALID_VALUE;
    if (idxs[0] != 0) return INVALID_VALUE;
    for (size_t a = 0; a < nattrs; a++) {
        if (attrs[a].order == 0) return INVALID_VALUE;
        if (a && idxs[a] <= idxs[a - 1]) return INVALID_VALUE;
        if (idxs[a] >= count) return INVALID_VALUE;
    }
    for (size_t i = 0; i < count; i++) {
        if (!sizes[i] || !dsts[i] || !srcs[i]) return INVALID_VALUE;
        int dd = device_range_ok(dsts[i], sizes[i]), sd = device_range_ok(srcs[i], sizes[i]);
        if ((containing(dsts[i]) && !dd) || (containing(srcs[i]) && !sd)) return INVALID_VALUE;
    }
    struct stream *st = stream;
    for (size_t i = 0; i < count; i++) {
        void *to = (void *)(uintptr_t)dsts[i];
        const void *from = (const void *)(uintptr_t)srcs[i];
        if (!device_range_ok(dsts[i], sizes[i]) && st->npending < MAX_PENDING) {
            st->pending[st->npending++] = (struct op){to, from, sizes[i]};
            continue;
        }
        memmove(to, from, sizes[i]);
    }
    return SUCCESS;
}
EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                      size_t count, void *attrs, size_t *idxs, size_t nattrs,
                                      void *stream) {
    LOCKED(do_copy_batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream));
}
#endif

static CUresult do_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    NEED_CTX();
    CUresult r = stream_ok(stream);
    if (r) return r;
    NO_CAPTURE(stream);
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) return INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    LOCKED(do_dtod(dst, src, n, stream));
}

static CUresult do_peer(CUdeviceptr dst, void *dctx, CUdeviceptr src, void *sctx, size_t n,
                        void *stream) {
    NEED_CTX();
    if (!ctx_of(dctx) || !ctx_of(sctx)) return INVALID_CONTEXT;
    CUresult r = stream_ok(stream);
    if (r) return r;
    NO_CAPTURE(stream);
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) return INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n);
    return SUCCESS;
}
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void *dctx, CUdeviceptr src, void *sctx,
                                  size_t n, void *stream) {
    LOCKED(do_peer(dst, dctx, src, sctx, n, stream));
}

static CUresult do_memset(CUdeviceptr dst, unsigned value, size_t n, int width, void *stream) {
    NEED_CTX();
    CUresult r = stream_ok(stream);
    if (r) return r;
    NO_CAPTURE(stream);
    if (dst % (CUdeviceptr)width) return INVALID_VALUE;
    if (!device_range_ok(dst, n * (size_t)width)) return INVALID_VALUE;
    unsigned char *p = (unsigned char *)(uintptr_t)dst;
    for (size_t i = 0; i < n; i++) memcpy(p + i * (size_t)width, &value, (size_t)width);
    return SUCCESS;
}
static CUresult do_memset_sync(CUdeviceptr dst, unsigned char v, size_t n) {
    NEED_CTX();
    if (!device_range_ok(dst, n)) return INVALID_VALUE;
    memset((void *)(uintptr_t)dst, v, n);
    return SUCCESS;
}
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    LOCKED(do_memset_sync(dst, v, n));
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *stream) {
    LOCKED(do_memset(dst, v, n, 1, stream));
}
EXPORT CUresult cuMemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, void *stream) {
    LOCKED(do_memset(dst, v, n, 2, stream));
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void *stream) {
    LOCKED(do_memset(dst, v, n, 4, stream));
}

#ifndef FAKECUDA_OLD
/* Stream-ordered allocation and pools (CUDA 11.2+; left out of the old build). */
struct pool {
    int dev;
    unsigned long long threshold;
    int handle_types;
    int imported; /* from cuMemPoolImportFromShareableHandle: no allocation */
};
static struct pool default_pools[MAX_DEV] = {{0, 0, 0, 0}, {1, 0, 0, 0}};

/* Like the real driver, stream-ordered allocation works in the stream's context
 * whatever context is current (or none); the legacy stream needs a current one. */
static CUresult stream_context(void *stream, struct ctx **c) {
    if (stream) {
        if (!find(stream, K_STREAM)) return INVALID_HANDLE;
        *c = ((struct stream *)stream)->ctx;
    } else {
        *c = current;
    }
    if (!*c) return INVALID_CONTEXT;
    if (!(*c)->alive) return CONTEXT_IS_DESTROYED;
    return SUCCESS;
}

static CUresult do_alloc_async(CUdeviceptr *p, size_t bytes, void *pool, void *stream) {
    struct ctx *saved = current, *c;
    CUresult r = stream_context(stream, &c);
    if (r) return r;
    NO_CAPTURE(stream);
    current = c;
    if (!attribute(current->dev, 115))
        r = NOT_SUPPORTED;
    else if (pool && !find(pool, K_POOL) && pool != &default_pools[0] && pool != &default_pools[1])
        r = INVALID_HANDLE;
    else if (pool && ((struct pool *)pool)->imported)
        r = NOT_SUPPORTED;
    else
        r = alloc_device(p, bytes);
    current = saved;
    return r;
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, void *stream) {
    LOCKED(do_alloc_async(p, bytes, NULL, stream));
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t bytes, void *pool, void *stream) {
    LOCKED(do_alloc_async(p, bytes, pool, stream));
}

static CUresult do_free_async(CUdeviceptr p, void *stream) {
    struct ctx *c;
    CUresult r = stream_context(stream, &c);
    if (r) return r;
    NO_CAPTURE(stream);
    if (stream) run_pending(stream);
    last_free_stream = stream;
    return free_device(p);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, void *stream) { LOCKED(do_free_async(p, stream)); }

static CUresult do_default_pool(void **pool, int dev) {
    NEED_INIT();
    if (!pool) return INVALID_VALUE;
    NEED_DEV(dev);
    if (!attribute(dev, 115)) return NOT_SUPPORTED;
    *pool = &default_pools[dev];
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetDefaultMemPool(void **pool, int dev) { LOCKED(do_default_pool(pool, dev)); }

struct pool_props {
    int alloc_type, handle_types;
    int location_type, location_id;
};
static CUresult do_pool_create(void **pool, const struct pool_props *props) {
    NEED_CTX();
    if (!pool || !props) return INVALID_VALUE;
    if (props->alloc_type != 1 || props->location_type != 1) return INVALID_VALUE;
    NEED_DEV(props->location_id);
    if (props->handle_types & ~1) return NOT_SUPPORTED;
    struct pool *p = calloc(1, sizeof *p);
    p->dev = props->location_id;
    p->handle_types = props->handle_types;
    track(p, K_POOL, 0, p->dev);
    *pool = p;
    return SUCCESS;
}
EXPORT CUresult cuMemPoolCreate(void **pool, const void *props) { LOCKED(do_pool_create(pool, props)); }

static struct pool *pool_ok(void *pool) {
    if (pool == &default_pools[0] || pool == &default_pools[1]) return pool;
    return find(pool, K_POOL) ? pool : NULL;
}
static CUresult do_pool_destroy(void *pool) {
    NEED_CTX();
    struct handle *h = find(pool, K_POOL);
    if (!h) return INVALID_HANDLE;
    untrack(h);
    free(pool);
    return SUCCESS;
}
EXPORT CUresult cuMemPoolDestroy(void *pool) { LOCKED(do_pool_destroy(pool)); }


/* Pool sharing: an exported pool is a memfd holding its identity; pointers are
 * 64 bytes (see legacy IPC); both open in the exporting process only (the
 * stand-in's memory is heap memory). A pointer imported into an imported pool is
 * counted until freed, and freeing it does not free the exporter's memory. */
#define POOL_MAGIC 0x6d6574726f6f6c73ULL
#define POOLPTR_MAGIC 0x6d65747270747273ULL
static CUresult do_pool_export(void *out, void *pool, int type, unsigned long long flags) {
    NEED_CTX();
    struct pool *p = pool_ok(pool);
    if (!out || flags || type != 1) return INVALID_VALUE;
    if (!p) return INVALID_HANDLE;
    if (!(p->handle_types & 1) || p->imported) return INVALID_VALUE;
    /* Not close-on-exec, like the driver's: metrale sets the flag. */
    int fd = memfd_create("fakecuda-pool", 0);
    if (fd < 0) return OUT_OF_MEMORY;
    struct ipc_bytes b = {POOL_MAGIC, (uint64_t)getpid(), (uint64_t)(uintptr_t)pool, 0, {0}};
    if (pwrite(fd, &b, sizeof b, 0) != (ssize_t)sizeof b) { close(fd); return OUT_OF_MEMORY; }
    *(int *)out = fd;
    return SUCCESS;
}
EXPORT CUresult cuMemPoolExportToShareableHandle(void *out, void *pool, int type, unsigned long long flags) {
    LOCKED(do_pool_export(out, pool, type, flags));
}
static CUresult do_pool_import(void **pool, void *handle, int type, unsigned long long flags) {
    NEED_CTX();
    if (!pool || flags || type != 1) return INVALID_VALUE;
    struct ipc_bytes b;
    /* Not an exported pool's descriptor: the driver says UNKNOWN. */
    if (pread((int)(intptr_t)handle, &b, sizeof b, 0) != (ssize_t)sizeof b) return UNKNOWN;
    if (b.magic != POOL_MAGIC) return UNKNOWN;
    if (b.pid != (uint64_t)getpid()) return INVALID_VALUE;
    struct pool *src = pool_ok((void *)(uintptr_t)b.ptr);
    if (!src) return INVALID_VALUE;
    struct pool *p = calloc(1, sizeof *p);
    p->dev = current->dev;
    p->handle_types = 1;
    p->imported = 1;
    track(p, K_POOL, 0, p->dev);
    *pool = p;
    return SUCCESS;
}
EXPORT CUresult cuMemPoolImportFromShareableHandle(void **pool, void *handle, int type, unsigned long long flags) {
    LOCKED(do_pool_import(pool, handle, type, flags));
}
static CUresult do_pool_export_ptr(struct ipc_bytes *out, CUdeviceptr ptr) {
    NEED_CTX();
    struct handle *h = find((void *)(uintptr_t)ptr, K_DEVMEM);
    if (!out || !h) return INVALID_VALUE;
    *out = (struct ipc_bytes){POOLPTR_MAGIC, (uint64_t)getpid(), ptr, h->bytes, {0}};
    return SUCCESS;
}
EXPORT CUresult cuMemPoolExportPointer(void *out, CUdeviceptr ptr) { LOCKED(do_pool_export_ptr(out, ptr)); }
static CUresult do_pool_import_ptr(CUdeviceptr *out, void *pool, const struct ipc_bytes *data) {
    NEED_CTX();
    struct pool *p = pool_ok(pool);
    if (!out || !data) return INVALID_VALUE;
    if (!p || !p->imported) return INVALID_HANDLE;
    if (data->magic != POOLPTR_MAGIC || data->pid != (uint64_t)getpid()) return INVALID_VALUE;
    if (!find((void *)(uintptr_t)data->ptr, K_DEVMEM)) return INVALID_VALUE;
    for (int i = 0; i < MAX_IPC_OPEN; i++)
        if (!pool_imports[i]) {
            pool_imports[i] = data->ptr;
            *out = data->ptr;
            return SUCCESS;
        }
    return OUT_OF_MEMORY;
}
EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *out, void *pool, void *data) {
    LOCKED(do_pool_import_ptr(out, pool, data));
}

static CUresult do_pool_attr(void *pool, int attr, void *value, int set) {
    NEED_CTX();
    struct pool *p = pool_ok(pool);
    if (!p || !value) return INVALID_VALUE;
    if (attr == 4) { /* release threshold */
        if (set) p->threshold = *(unsigned long long *)value;
        else *(unsigned long long *)value = p->threshold;
        return SUCCESS;
    }
    if (!set && (attr == 5 || attr == 7)) { /* reserved / used current */
        *(unsigned long long *)value = 0;
        return SUCCESS;
    }
    return INVALID_VALUE;
}
EXPORT CUresult cuMemPoolSetAttribute(void *pool, int attr, void *value) {
    LOCKED(do_pool_attr(pool, attr, value, 1));
}
EXPORT CUresult cuMemPoolGetAttribute(void *pool, int attr, void *value) {
    LOCKED(do_pool_attr(pool, attr, value, 0));
}

static CUresult do_pool_trim(void *pool, size_t keep) {
    NEED_CTX();
    (void)keep;
    return pool_ok(pool) ? SUCCESS : INVALID_VALUE;
}
EXPORT CUresult cuMemPoolTrimTo(void *pool, size_t keep) { LOCKED(do_pool_trim(pool, keep)); }

struct mem_location {
    int type;
    int id;
};
static CUresult do_prefetch(CUdeviceptr p, size_t n, struct mem_location loc, unsigned flags,
                            void *stream) {
    NEED_CTX();
    CUresult r = stream_ok(stream);
    if (r) return r;
    if (flags || !device_range_ok(p, n)) return INVALID_VALUE;
    if (loc.type == 1) {
        NEED_DEV(loc.id);
        last_prefetch_dev = loc.id;
    } else if (loc.type == 2) {
        last_prefetch_dev = -1;
    } else {
        return INVALID_VALUE;
    }
    return SUCCESS;
}
EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, struct mem_location loc,
                                      unsigned flags, void *stream) {
    LOCKED(do_prefetch(p, n, loc, flags, stream));
}
#endif

/* ---- graphs --------------------------------------------------------------- */

static CUresult do_begin_capture(void *s, int mode) {
    NEED_CTX();
    if (!s) return STREAM_CAPTURE_UNSUPPORTED;
    CUresult r = stream_ok(s);
    if (r) return r;
    if (mode < 0 || mode > 2) return INVALID_VALUE;
    struct stream *st = s;
    if (st->capture) return STREAM_CAPTURE_UNSUPPORTED;
    st->capture = calloc(1, sizeof *st->capture);
    st->capture->ctx = current;
    st->origin = st;
    st->ntails = 0;
    return SUCCESS;
}
EXPORT CUresult cuStreamBeginCapture_v2(void *s, int mode) { LOCKED(do_begin_capture(s, mode)); }

static CUresult do_end_capture(void *s, void **graph) {
    NEED_CTX();
    if (!graph) return INVALID_VALUE;
    *graph = NULL;
    CUresult r = stream_ok(s);
    if (r) return r;
    struct stream *st = s;
    if (!st || !st->capture || st->origin != st) return INVALID_VALUE;
    struct graph *g = st->capture;
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_STREAM && ((struct stream *)handles[i].p)->capture == g) {
            struct stream *o = handles[i].p;
            o->capture = NULL;
            o->origin = NULL;
            o->ntails = 0;
        }
    if (g->invalid) {
        free_graph(g);
        return STREAM_CAPTURE_INVALIDATED;
    }
    track(g, K_GRAPH, 0, current->dev);
    *graph = g;
    return SUCCESS;
}
EXPORT CUresult cuStreamEndCapture(void *s, void **graph) { LOCKED(do_end_capture(s, graph)); }

static CUresult do_capture_info(void *s, int *status, unsigned long long *id, void **graph,
                                void *deps, void *edges, size_t *ndeps) {
    NEED_CTX();
    CUresult r = stream_ok(s);
    if (r) return r;
    struct stream *st = s;
    if (status) *status = !st || !st->capture ? 0 : st->capture->invalid ? 2 : 1;
    if (id) *id = st && st->capture ? (unsigned long long)(uintptr_t)st->capture : 0;
    if (graph) *graph = st ? st->capture : NULL;
    (void)deps;
    (void)edges;
    if (ndeps) *ndeps = st ? (size_t)st->ntails : 0;
    return SUCCESS;
}
EXPORT CUresult cuStreamGetCaptureInfo_v3(void *s, int *status, unsigned long long *id,
                                          void **graph, void *deps, void *edges, size_t *ndeps) {
    LOCKED(do_capture_info(s, status, id, graph, deps, edges, ndeps));
}

static CUresult do_graph_create(void **graph, unsigned flags) {
    NEED_CTX();
    if (!graph || flags) return INVALID_VALUE;
    struct graph *g = calloc(1, sizeof *g);
    g->ctx = current;
    track(g, K_GRAPH, 0, current->dev);
    *graph = g;
    return SUCCESS;
}
EXPORT CUresult cuGraphCreate(void **graph, unsigned flags) { LOCKED(do_graph_create(graph, flags)); }

static CUresult do_graph_destroy(void *graph) {
    struct handle *h = find(graph, K_GRAPH);
    if (!h) return INVALID_HANDLE;
    if (current && !current->alive) return CONTEXT_IS_DESTROYED;
    untrack(h);
    free_graph(graph);
    return SUCCESS;
}
EXPORT CUresult cuGraphDestroy(void *graph) { LOCKED(do_graph_destroy(graph)); }

/* A live graph: a tracked one, or the body of a conditional node of one. */
static struct graph *graph_ok(void *graph) {
    if (find(graph, K_GRAPH)) return graph;
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_NODE && ((struct node *)handles[i].p)->body == graph) return graph;
    return NULL;
}

static CUresult do_graph_nodes(void *graph, void **nodes, size_t *n) {
    struct graph *g = graph_ok(graph);
    if (!g || !n) return INVALID_VALUE;
    /* As the driver (seen on CUDA 13.0): an array with room for no node is refused. */
    if (nodes && *n == 0) return INVALID_VALUE;
    if (nodes) {
        size_t k = *n < (size_t)g->n ? *n : (size_t)g->n;
        for (size_t i = 0; i < k; i++) nodes[i] = g->nodes[i];
    }
    *n = (size_t)g->n;
    return SUCCESS;
}
EXPORT CUresult cuGraphGetNodes(void *graph, void **nodes, size_t *n) {
    LOCKED(do_graph_nodes(graph, nodes, n));
}

static CUresult do_graph_edges(void *graph, void **from, void **to, void *data, size_t *n) {
    struct graph *g = graph_ok(graph);
    (void)data;
    if (!g || !n) return INVALID_VALUE;
    if (from && to) {
        size_t k = *n < (size_t)g->nedges ? *n : (size_t)g->nedges;
        for (size_t i = 0; i < k; i++) {
            from[i] = g->from[i];
            to[i] = g->to[i];
        }
    }
    *n = (size_t)g->nedges;
    return SUCCESS;
}
EXPORT CUresult cuGraphGetEdges_v2(void *graph, void **from, void **to, void *data, size_t *n) {
    LOCKED(do_graph_edges(graph, from, to, data, n));
}

static CUresult do_node_type(void *node, int *type) {
    if (!find(node, K_NODE) || !type) return INVALID_VALUE;
    *type = ((struct node *)node)->type;
    return SUCCESS;
}
EXPORT CUresult cuGraphNodeGetType(void *node, int *type) { LOCKED(do_node_type(node, type)); }

struct kparams {
    void *func;
    unsigned grid[3], block[3], shared;
    void **params;
    void **extra;
    void *kern;
    void *ctx;
};
static CUresult do_kernel_node_params(void *node, struct kparams *p) {
    struct node *n = node;
    if (!find(node, K_NODE) || !p || n->type != NODE_KERNEL) return INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->func = n->f;
    memcpy(p->grid, n->grid, sizeof p->grid);
    memcpy(p->block, n->block, sizeof p->block);
    p->shared = n->shared;
    return SUCCESS;
}
EXPORT CUresult cuGraphKernelNodeGetParams_v2(void *node, struct kparams *p) {
    LOCKED(do_kernel_node_params(node, p));
}

static CUresult do_add_kernel_node(void **node, void *graph, void *const *deps, size_t ndeps,
                                   const struct kparams *p) {
    NEED_CTX();
    struct graph *g = graph_ok(graph);
    if (!node || !g || !p) return INVALID_VALUE;
    struct func *fn = p->func;
    if (!find(fn, K_FUNC)) return INVALID_HANDLE;
    CUresult r = check_launch(fn, p->grid, p->block, p->shared, p->params);
    if (r) return r;
    for (size_t i = 0; i < ndeps; i++)
        if (!find(deps[i], K_NODE)) return INVALID_VALUE;
    struct node n;
    fill_node(&n, fn, p->grid, p->block, p->shared, p->params);
    struct node *added = add_node(g, &n, (struct node *const *)deps, (int)ndeps);
    if (!added) return OUT_OF_MEMORY;
    *node = added;
    return SUCCESS;
}
EXPORT CUresult cuGraphAddKernelNode_v2(void **node, void *graph, void *const *deps, size_t ndeps,
                                        const struct kparams *p) {
    LOCKED(do_add_kernel_node(node, graph, deps, ndeps, p));
}

static struct graph *copy_graph(struct graph *g, struct node **orig) {
    struct graph *c = calloc(1, sizeof *c);
    c->ctx = g->ctx;
    for (int i = 0; i < g->n; i++) {
        c->nodes[i] = malloc(sizeof(struct node));
        *c->nodes[i] = *g->nodes[i];
        c->nodes[i]->body = NULL;
        if (orig) orig[i] = g->nodes[i];
    }
    c->n = g->n;
    /* An executable graph holds the user objects of its graph. */
    for (int i = 0; i < g->nuobj; i++) {
        c->uobj[i] = g->uobj[i];
        c->uobj_refs[i] = g->uobj_refs[i];
        g->uobj[i]->refs += g->uobj_refs[i];
    }
    c->nuobj = g->nuobj;
    return c;
}

#ifndef FAKECUDA_OLD
/* ---- user objects ----------------------------------------------------------- */

static CUresult do_uobj_create(void **out, void *ptr, void (*destroy)(void *), unsigned initial,
                               unsigned flags) {
    if (!out || !destroy || initial == 0 || flags != 1 /* NO_DESTRUCTOR_SYNC */) return INVALID_VALUE;
    struct uobj *u = calloc(1, sizeof *u);
    if (!u) return OUT_OF_MEMORY;
    *u = (struct uobj){UOBJ_MAGIC, initial, ptr, destroy};
    uobjs_live++;
    *out = u;
    return SUCCESS;
}
EXPORT CUresult cuUserObjectCreate(void **out, void *ptr, void (*destroy)(void *), unsigned initial,
                                   unsigned flags) {
    LOCKED(do_uobj_create(out, ptr, destroy, initial, flags));
}
static CUresult do_uobj_release(struct uobj *u, unsigned count) {
    if (!u || u->magic != UOBJ_MAGIC || count == 0 || (long)count > u->refs) return INVALID_VALUE;
    uobj_release(u, count);
    return SUCCESS;
}
EXPORT CUresult cuUserObjectRelease(void *u, unsigned count) { LOCKED(do_uobj_release(u, count)); }
static CUresult do_uobj_retain(struct uobj *u, unsigned count) {
    if (!u || u->magic != UOBJ_MAGIC || count == 0) return INVALID_VALUE;
    u->refs += count;
    return SUCCESS;
}
EXPORT CUresult cuUserObjectRetain(void *u, unsigned count) { LOCKED(do_uobj_retain(u, count)); }
/* A graph a user object may be retained by: a tracked one, or one a stream is
 * capturing into. */
static int graph_for_uobj(void *graph) {
    if (find(graph, K_GRAPH)) return 1;
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_STREAM && ((struct stream *)handles[i].p)->capture == graph) return 1;
    return 0;
}
static CUresult do_graph_retain_uobj(struct graph *g, struct uobj *u, unsigned count, unsigned flags) {
    if (!g || !graph_for_uobj(g) || !u || u->magic != UOBJ_MAGIC || count == 0 || flags > 1)
        return INVALID_VALUE;
    if (flags == 1 && (long)count > u->refs) return INVALID_VALUE; /* MOVE: the caller's references */
    int i = 0;
    while (i < g->nuobj && g->uobj[i] != u) i++;
    if (i == g->nuobj) {
        if (g->nuobj >= MAX_GRAPH_UOBJS) return OUT_OF_MEMORY;
        g->uobj[i] = u;
        g->uobj_refs[i] = 0;
        g->nuobj++;
    }
    g->uobj_refs[i] += count;
    if (flags == 0) u->refs += count;
    return SUCCESS;
}
EXPORT CUresult cuGraphRetainUserObject(void *graph, void *u, unsigned count, unsigned flags) {
    LOCKED(do_graph_retain_uobj(graph, u, count, flags));
}
#endif
/* Replayed kernels that ran (behind jobs of their stream) after their
 * module or library was unloaded. */
EXPORT long fakecuda_kernels_run_unloaded(void) {
    pthread_mutex_lock(&lock);
    long n = kernels_run_unloaded;
    pthread_mutex_unlock(&lock);
    return n;
}
/* Live user objects (references not all released). */
EXPORT long fakecuda_user_objects(void) {
    pthread_mutex_lock(&lock);
    long n = uobjs_live;
    pthread_mutex_unlock(&lock);
    return n;
}

static CUresult do_instantiate(void **exec, void *graph, unsigned long long flags) {
    NEED_CTX();
    struct graph *g = find(graph, K_GRAPH) ? graph : NULL;
    if (!exec || !g) return INVALID_VALUE;
    if (flags & ~0xfull) return INVALID_VALUE;
    struct gexec *e = calloc(1, sizeof *e);
    e->ctx = current;
    e->g = copy_graph(g, e->orig);
    track(e, K_EXEC, 0, current->dev);
    *exec = e;
    return SUCCESS;
}
EXPORT CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    LOCKED(do_instantiate(exec, graph, flags));
}

static CUresult do_exec_destroy(void *exec) {
    struct handle *h = find(exec, K_EXEC);
    if (!h) return INVALID_HANDLE;
    if (current && !current->alive) return CONTEXT_IS_DESTROYED;
    untrack(h);
    free_graph(((struct gexec *)exec)->g);
    free(exec);
    return SUCCESS;
}
EXPORT CUresult cuGraphExecDestroy(void *exec) { LOCKED(do_exec_destroy(exec)); }

static CUresult do_graph_launch(void *exec, void *stream) {
    NEED_CTX();
    struct gexec *e = exec;
    if (!find(exec, K_EXEC)) return INVALID_HANDLE;
    CUresult r = stream_ok(stream);
    if (r) return r;
    if (e->ctx != current) return INVALID_HANDLE;
    for (int i = 0; i < e->g->n; i++) {
        struct node *n = e->g->nodes[i];
        if (n->type == NODE_KERNEL) {
            record(n->f, n->grid, n->block, n->shared, stream, n->nparams, n->params);
            /* Behind jobs, the kernel runs when they have: its code is checked
             * then (fakecuda_kernels_run_unloaded). */
            if (job_stream(stream)->head) {
                struct job k = {.type = JOB_KERNEL, .data = n->f};
                r = enqueue(stream, &k);
                if (r) return r;
            }
        } else if (n->type == NODE_HOST || n->type == NODE_MEM_OP) {
            r = enqueue(stream, &n->job);
            if (r) return r;
        }
    }
    /* A replay that waits behind jobs of the stream (its own host nodes, or
     * host functions queued before it) is in flight until they ran: it holds
     * the executable's user objects until then, as CUDA's launches do. */
    struct stream *st = job_stream(stream);
    if (e->g->nuobj && st->head) {
        struct uobj_ref *held = malloc(sizeof *held * (size_t)e->g->nuobj);
        if (!held) return OUT_OF_MEMORY;
        for (int i = 0; i < e->g->nuobj; i++) {
            held[i] = (struct uobj_ref){e->g->uobj[i], e->g->uobj_refs[i]};
            e->g->uobj[i]->refs += e->g->uobj_refs[i];
        }
        struct job release = {.type = JOB_UOBJ_RELEASE, .data = held, .value = (unsigned long long)e->g->nuobj};
        r = enqueue(stream, &release);
        if (r) {
            release_uobj_list(held, e->g->nuobj);
            return r;
        }
    }
    return SUCCESS;
}
EXPORT CUresult cuGraphLaunch(void *exec, void *stream) { LOCKED(do_graph_launch(exec, stream)); }

static CUresult do_graph_upload(void *exec, void *stream) {
    NEED_CTX();
    if (!find(exec, K_EXEC)) return INVALID_HANDLE;
    return stream_ok(stream);
}
EXPORT CUresult cuGraphUpload(void *exec, void *stream) { LOCKED(do_graph_upload(exec, stream)); }

struct update_info {
    int result;
    void *error_node;
    void *error_from;
};
static CUresult do_exec_update(void *exec, void *graph, struct update_info *info) {
    NEED_CTX();
    struct gexec *e = exec;
    struct graph *g = find(graph, K_GRAPH) ? graph : NULL;
    if (!find(exec, K_EXEC) || !g || !info) return INVALID_VALUE;
    memset(info, 0, sizeof *info);
    if (g->n != e->g->n) {
        info->result = 2; /* topology changed */
        info->error_node = g->n > e->g->n ? g->nodes[e->g->n] : (g->n ? g->nodes[g->n - 1] : NULL);
        return GRAPH_EXEC_UPDATE_FAILURE;
    }
    for (int i = 0; i < g->n; i++) {
        if (g->nodes[i]->type != e->g->nodes[i]->type) {
            info->result = 3;
            info->error_node = g->nodes[i];
            return GRAPH_EXEC_UPDATE_FAILURE;
        }
        if (g->nodes[i]->f != e->g->nodes[i]->f) {
            info->result = 4; /* function changed */
            info->error_node = g->nodes[i];
            return GRAPH_EXEC_UPDATE_FAILURE;
        }
    }
    /* Nodes of the graph the executable was instantiated from keep naming them. */
    for (int i = 0; i < g->n; i++) {
        *e->g->nodes[i] = *g->nodes[i];
        e->g->nodes[i]->body = NULL;
    }
    /* The new graph's user-object references are cloned and replace the
     * executable's (replays in flight keep their own until they ran). The
     * new ones are taken first, so an object in both never reaches zero. */
    for (int i = 0; i < g->nuobj; i++) g->uobj[i]->refs += g->uobj_refs[i];
    for (int i = 0; i < e->g->nuobj; i++) uobj_release(e->g->uobj[i], e->g->uobj_refs[i]);
    for (int i = 0; i < g->nuobj; i++) {
        e->g->uobj[i] = g->uobj[i];
        e->g->uobj_refs[i] = g->uobj_refs[i];
    }
    e->g->nuobj = g->nuobj;
    return SUCCESS;
}
EXPORT CUresult cuGraphExecUpdate_v2(void *exec, void *graph, struct update_info *info) {
    LOCKED(do_exec_update(exec, graph, info));
}

static CUresult do_exec_node_params(void *exec, void *node, const struct kparams *p) {
    NEED_CTX();
    struct gexec *e = exec;
    if (!find(exec, K_EXEC) || !p) return INVALID_VALUE;
    for (int i = 0; i < e->g->n; i++)
        if (e->orig[i] == node) {
            struct node *n = e->g->nodes[i];
            if (p->func != n->f) return INVALID_VALUE;
            CUresult r = check_launch(n->f, p->grid, p->block, p->shared, p->params);
            if (r) return r;
            fill_node(n, n->f, p->grid, p->block, p->shared, p->params);
            return SUCCESS;
        }
    return INVALID_VALUE;
}
EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(void *exec, void *node, const struct kparams *p) {
    LOCKED(do_exec_node_params(exec, node, p));
}

static CUresult do_dot(void *graph, const char *path, unsigned flags) {
    struct graph *g = graph_ok(graph);
    (void)flags;
    if (!g || !path) return INVALID_VALUE;
    FILE *f = fopen(path, "w");
    if (!f) return OPERATING_SYSTEM;
    fprintf(f, "digraph fakecuda {\n");
    for (int i = 0; i < g->n; i++)
        fprintf(f, "  n%p [label=\"%s\"];\n", (void *)g->nodes[i],
                g->nodes[i]->type == NODE_KERNEL ? g->nodes[i]->f->name : "node");
    for (int i = 0; i < g->nedges; i++)
        fprintf(f, "  n%p -> n%p;\n", (void *)g->from[i], (void *)g->to[i]);
    fprintf(f, "}\n");
    fclose(f);
    return SUCCESS;
}
EXPORT CUresult cuGraphDebugDotPrint(void *graph, const char *path, unsigned flags) {
    LOCKED(do_dot(graph, path, flags));
}

#ifndef FAKECUDA_OLD
/* Conditional nodes (CUDA 12.4+). */
static CUresult do_cond_handle(unsigned long long *h, void *graph, void *ctx, unsigned value,
                               unsigned flags) {
    NEED_CTX();
    (void)value;
    (void)flags;
    if (!h || !graph_ok(graph) || !ctx_of(ctx)) return INVALID_VALUE;
    *h = next_cond++;
    return SUCCESS;
}
EXPORT CUresult cuGraphConditionalHandleCreate(unsigned long long *h, void *graph, void *ctx,
                                               unsigned value, unsigned flags) {
    LOCKED(do_cond_handle(h, graph, ctx, value, flags));
}

struct node_params {
    int type;
    int reserved0[3];
    union {
        long long reserved1[29];
        struct {
            unsigned long long handle;
            int type;
            unsigned size;
            void **graph_out;
            void *ctx;
        } conditional;
    } u;
    long long reserved2;
};
static CUresult do_add_node(void **node, void *graph, void *const *deps, const void *data,
                            size_t ndeps, struct node_params *p) {
    NEED_CTX();
    struct graph *g = graph_ok(graph);
    (void)data;
    if (!node || !g || !p) return INVALID_VALUE;
    if (p->type != NODE_CONDITIONAL || p->u.conditional.size != 1) return NOT_SUPPORTED;
    struct node n;
    memset(&n, 0, sizeof n);
    n.type = NODE_CONDITIONAL;
    n.cond = p->u.conditional.handle;
    struct node *added = add_node(g, &n, (struct node *const *)deps, (int)ndeps);
    if (!added) return OUT_OF_MEMORY;
    added->body = calloc(1, sizeof *added->body);
    added->body->ctx = current;
    added->body->body = 1;
    p->u.conditional.graph_out = (void **)&added->body;
    *node = added;
    return SUCCESS;
}
EXPORT CUresult cuGraphAddNode_v2(void **node, void *graph, void *const *deps, const void *data,
                                  size_t ndeps, struct node_params *p) {
    LOCKED(do_add_node(node, graph, deps, data, ndeps, p));
}
#endif

/* ---- host functions and stream memory operations --------------------------- */

/* Queue `j` on the stream, or add it to the graph the stream is capturing. */
static CUresult queue_job(void *s, const struct job *j, int node_type) {
    CUresult r = stream_ok(s);
    if (r) return r;
    struct stream *st = s;
    if (st && st->capture) {
        struct node n;
        memset(&n, 0, sizeof n);
        n.type = node_type;
        n.job = *j;
        struct node *added = add_node(st->capture, &n, st->tails, st->ntails);
        if (!added) return OUT_OF_MEMORY;
        st->tails[0] = added;
        st->ntails = 1;
        return SUCCESS;
    }
    return enqueue(s, j);
}

/* Run `body` in the context of stream `s`, as the driver does for the calls
 * whose only handle is a stream (memory operations, host functions): it takes
 * the context from the stream, whatever is current (seen on driver 580). The
 * null stream still means the current context's. With `stream_ctx_strict` the
 * stream's context must be current instead (refused before anything queues). */
#define ON_STREAM_CTX(s, body)                                                      \
    do {                                                                            \
        struct handle *h__ = (s) ? find((s), K_STREAM) : NULL;                      \
        if ((s) && !h__) return INVALID_HANDLE;                                     \
        if (stream_ctx_strict && h__) {                                             \
            if (!current) return INVALID_CONTEXT;                                   \
            if (((struct stream *)(s))->ctx != current) return INVALID_HANDLE;      \
        }                                                                           \
        struct ctx *saved__ = current;                                              \
        if (h__) current = ((struct stream *)(s))->ctx;                             \
        CUresult r2__ = (body);                                                     \
        current = saved__;                                                          \
        return r2__;                                                                \
    } while (0)

static CUresult do_host_func(void *s, void (*fn)(void *), void *data) {
    NEED_CTX();
    if (!fn) return INVALID_VALUE;
    struct job j = {.type = JOB_HOST, .fn = fn, .data = data};
    return queue_job(s, &j, NODE_HOST);
}
static CUresult host_func_on(void *s, void (*fn)(void *), void *data) {
    ON_STREAM_CTX(s, do_host_func(s, fn, data));
}
EXPORT CUresult cuLaunchHostFunc(void *s, void (*fn)(void *), void *data) {
    LOCKED(host_func_on(s, fn, data));
}

/* A device word for a memory operation: non-null and aligned. */
static CUresult mem_op_here(void *s, int type, CUdeviceptr addr, unsigned long long value,
                            unsigned flags, int wide) {
    NEED_CTX();
    if (!addr || addr % (wide ? 8 : 4)) return INVALID_VALUE;
    if (type == JOB_WAIT_VALUE && (flags & ~(3u | (1u << 30)))) return INVALID_VALUE;
    /* The v2 write refuses NO_MEMORY_BARRIER (1) too (seen on driver 580). */
    if (type == JOB_WRITE_VALUE && flags) return INVALID_VALUE;
    struct job j = {.type = type, .addr = addr, .value = value, .flags = flags, .wide = wide};
    return queue_job(s, &j, NODE_MEM_OP);
}
static CUresult mem_op(void *s, int type, CUdeviceptr addr, unsigned long long value,
                       unsigned flags, int wide) {
    ON_STREAM_CTX(s, mem_op_here(s, type, addr, value, flags, wide));
}
EXPORT CUresult cuStreamWaitValue32_v2(void *s, CUdeviceptr addr, unsigned value, unsigned flags) {
    LOCKED(mem_op(s, JOB_WAIT_VALUE, addr, value, flags, 0));
}
EXPORT CUresult cuStreamWaitValue64_v2(void *s, CUdeviceptr addr, unsigned long long value,
                                       unsigned flags) {
    LOCKED(mem_op(s, JOB_WAIT_VALUE, addr, value, flags, 1));
}
EXPORT CUresult cuStreamWriteValue32_v2(void *s, CUdeviceptr addr, unsigned value, unsigned flags) {
    LOCKED(mem_op(s, JOB_WRITE_VALUE, addr, value, flags, 0));
}
EXPORT CUresult cuStreamWriteValue64_v2(void *s, CUdeviceptr addr, unsigned long long value,
                                        unsigned flags) {
    LOCKED(mem_op(s, JOB_WRITE_VALUE, addr, value, flags, 1));
}

/* CUstreamBatchMemOpParams: 48 bytes; operation at 0, address at 8, value at 16,
 * flags at 24 (for a flush or barrier: flags at 4). */
struct batch_op {
    unsigned operation;
    unsigned flags4;
    CUdeviceptr address;
    unsigned long long value;
    unsigned flags;
    unsigned pad0;
    CUdeviceptr alias;
    unsigned long long pad1;
};
static CUresult do_batch(void *s, unsigned count, const struct batch_op *ops, unsigned flags) {
    NEED_CTX();
    /* As the driver (seen on driver 580): at most 255 operations per batch, and
     * no write flag (NO_MEMORY_BARRIER is refused by the v2 entry point). */
    if (flags || (count && !ops) || count > 255) return INVALID_VALUE;
    CUresult r = stream_ok(s);
    if (r) return r;
    /* Check every operation before queueing any, as the driver does. */
    for (unsigned i = 0; i < count; i++) {
        switch (ops[i].operation) {
        case 1: case 2: if (!ops[i].address || ops[i].address % 4) return INVALID_VALUE;
            if (ops[i].operation == 2 && ops[i].flags) return INVALID_VALUE;
            break;
        case 4: case 5: if (!ops[i].address || ops[i].address % 8) return INVALID_VALUE;
            if (ops[i].operation == 5 && ops[i].flags) return INVALID_VALUE;
            break;
        case 3: case 6: break;
        default: return INVALID_VALUE;
        }
    }
    for (unsigned i = 0; i < count; i++) {
        unsigned op = ops[i].operation;
        if (op == 3 || op == 6) continue; /* flush, barrier: nothing to model */
        int wide = op == 4 || op == 5;
        int type = op == 1 || op == 4 ? JOB_WAIT_VALUE : JOB_WRITE_VALUE;
        unsigned long long v = wide ? ops[i].value : (unsigned)ops[i].value;
        struct job j = {.type = type, .addr = ops[i].address, .value = v,
                        .flags = ops[i].flags, .wide = wide};
        if ((r = queue_job(s, &j, NODE_MEM_OP))) return r;
    }
    return SUCCESS;
}
static CUresult batch_on(void *s, unsigned count, const void *ops, unsigned flags) {
    ON_STREAM_CTX(s, do_batch(s, count, ops, flags));
}
EXPORT CUresult cuStreamBatchMemOp_v2(void *s, unsigned count, const void *ops, unsigned flags) {
    LOCKED(batch_on(s, count, ops, flags));
}

static CUresult do_host_alloc(void **p, size_t bytes, unsigned flags) {
    NEED_CTX();
    if (!p || !bytes || (flags & ~7u)) return INVALID_VALUE;
    *p = host_alloc(bytes);
    if (!*p) return OUT_OF_MEMORY;
    track(*p, K_HOSTMEM, bytes, current->dev);
    return SUCCESS;
}
EXPORT CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags) {
    LOCKED(do_host_alloc(p, bytes, flags));
}

/* Mapped host memory has the same address on the "device". */
static CUresult do_host_device_ptr(CUdeviceptr *d, void *p, unsigned flags) {
    NEED_CTX();
    if (!d || flags) return INVALID_VALUE;
    struct handle *h = NULL;
    for (int i = 0; i < TABLE && !h; i++)
        if (handles[i].kind == K_HOSTMEM && (char *)p >= (char *)handles[i].p &&
            (char *)p < (char *)handles[i].p + handles[i].bytes)
            h = &handles[i];
    if (!h) return INVALID_VALUE;
    *d = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}
EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) {
    LOCKED(do_host_device_ptr(d, p, flags));
}

/* Jobs (host functions, memory operations) queued on the stream and not yet run. */
EXPORT long fakecuda_jobs_pending(void *s) {
    pthread_mutex_lock(&lock);
    struct stream *st = job_stream(s);
    long n = st->enq - st->done;
    pthread_mutex_unlock(&lock);
    return n;
}

static CUresult do_add_callback(void *s, void (*cb)(void *, CUresult, void *), void *data,
                                unsigned flags) {
    NEED_CTX();
    if (!cb || flags) return INVALID_VALUE;
    CUresult r = stream_ok(s);
    if (r) return r;
    if (s && ((struct stream *)s)->capture) {
        ((struct stream *)s)->capture->invalid = 1;
        return STREAM_CAPTURE_UNSUPPORTED;
    }
    struct job j = {.type = JOB_CALLBACK, .callback = cb, .data = data, .stream = s};
    return enqueue(s, &j);
}
EXPORT CUresult cuStreamAddCallback(void *s, void (*cb)(void *, CUresult, void *), void *data,
                                    unsigned flags) {
    LOCKED(do_add_callback(s, cb, data, flags));
}

struct host_params {
    void (*fn)(void *);
    void *data;
};
static CUresult do_host_node_params(void *node, struct host_params *p) {
    NEED_CTX();
    struct node *n = find(node, K_NODE) ? node : NULL;
    if (!n || !p || n->type != NODE_HOST) return INVALID_VALUE;
    p->fn = n->job.fn;
    p->data = n->job.data;
    return SUCCESS;
}
EXPORT CUresult cuGraphHostNodeGetParams(void *node, struct host_params *p) {
    LOCKED(do_host_node_params(node, p));
}

/* ---- tensor maps (CUDA 12.0+) --------------------------------------------- */
/* The stand-in's "encoding" writes the arguments it received into the 128-byte
 * map, so tests can read back exactly what reached the driver:
 *   q0: 'TMAP' magic (low 32 bits), data type (bits 32..39), rank (40..47),
 *       interleave (48..51), swizzle (52..55), L2 promotion (56..59), OOB fill (60..63)
 *   q1: global address;  q2..q6: sizes;  q7..q10: byte strides;
 *   q11: box sizes 0..3 (16 bits each);  q12: box size 4 (bits 0..15), element
 *       strides (8 bits each from bit 16). */
#define TMAP_MAGIC 0x50414d54ull
#ifndef FAKECUDA_OLD
static CUresult do_tmap_encode(unsigned long long *map, unsigned dtype, unsigned rank, void *addr,
                               const unsigned long long *dims, const unsigned long long *strides,
                               const unsigned *box, const unsigned *estrides, unsigned interleave,
                               unsigned swizzle, unsigned l2, unsigned oob) {
    if (!map || ((uintptr_t)map % 64) || !dims || !box || !estrides) return INVALID_VALUE;
    if (rank < 1 || rank > 5 || (rank > 1 && !strides)) return INVALID_VALUE;
    if (dtype > 15 || interleave > 2 || swizzle > 6 || l2 > 3 || oob > 1) return INVALID_VALUE;
    if (interleave == 2 && swizzle != 1) return INVALID_VALUE; /* 32-byte interleave needs swizzle 32B */
    memset(map, 0, 128);
    map[0] = TMAP_MAGIC | ((unsigned long long)dtype << 32) | ((unsigned long long)rank << 40) |
             ((unsigned long long)interleave << 48) | ((unsigned long long)swizzle << 52) |
             ((unsigned long long)l2 << 56) | ((unsigned long long)oob << 60);
    map[1] = (unsigned long long)(uintptr_t)addr;
    for (unsigned i = 0; i < rank; i++) map[2 + i] = dims[i];
    for (unsigned i = 0; i + 1 < rank; i++) map[7 + i] = strides[i];
    for (unsigned i = 0; i < rank && i < 4; i++) map[11] |= (unsigned long long)(box[i] & 0xffff) << (16 * i);
    if (rank == 5) map[12] |= box[4] & 0xffff;
    for (unsigned i = 0; i < rank; i++) map[12] |= (unsigned long long)(estrides[i] & 0xff) << (16 + 8 * i);
    return SUCCESS;
}
EXPORT CUresult cuTensorMapEncodeTiled(unsigned long long *map, unsigned dtype, unsigned rank,
                                       void *addr, const unsigned long long *dims,
                                       const unsigned long long *strides, const unsigned *box,
                                       const unsigned *estrides, unsigned interleave,
                                       unsigned swizzle, unsigned l2, unsigned oob) {
    LOCKED(do_tmap_encode(map, dtype, rank, addr, dims, strides, box, estrides, interleave, swizzle,
                          l2, oob));
}
/* An im2col map: as a tiled one without box sizes, and
 *   q13: lower corners (16 bits each, two's complement), q14: upper corners,
 *   q15: 1 (im2col) | channels per pixel << 8 | pixels per column << 32. */
static CUresult do_tmap_im2col(unsigned long long *map, unsigned dtype, unsigned rank, void *addr,
                               const unsigned long long *dims, const unsigned long long *strides,
                               const int *lower, const int *upper, unsigned channels,
                               unsigned pixels, const unsigned *estrides, unsigned interleave,
                               unsigned swizzle, unsigned l2, unsigned oob) {
    if (rank < 3 || !lower || !upper) return INVALID_VALUE;
    static const unsigned ones[5] = {1, 1, 1, 1, 1};
    CUresult r = do_tmap_encode(map, dtype, rank, addr, dims, strides, ones, estrides, interleave,
                                swizzle, l2, oob);
    if (r) return r;
    map[11] = 0;
    map[12] &= ~0xffffull;
    for (unsigned i = 0; i + 2 < rank; i++) {
        map[13] |= (unsigned long long)((unsigned)lower[i] & 0xffff) << (16 * i);
        map[14] |= (unsigned long long)((unsigned)upper[i] & 0xffff) << (16 * i);
    }
    map[15] = 1 | ((unsigned long long)(channels & 0xffffff) << 8) | ((unsigned long long)pixels << 32);
    return SUCCESS;
}
EXPORT CUresult cuTensorMapEncodeIm2col(unsigned long long *map, unsigned dtype, unsigned rank,
                                        void *addr, const unsigned long long *dims,
                                        const unsigned long long *strides, const int *lower,
                                        const int *upper, unsigned channels, unsigned pixels,
                                        const unsigned *estrides, unsigned interleave,
                                        unsigned swizzle, unsigned l2, unsigned oob) {
    LOCKED(do_tmap_im2col(map, dtype, rank, addr, dims, strides, lower, upper, channels, pixels,
                          estrides, interleave, swizzle, l2, oob));
}
/* A wide im2col map (CUDA 12.8+): as an im2col one, with one width offset per
 * corner in q13 / q14 and q15's low byte 2 | mode << 4. */
static CUresult do_tmap_im2col_wide(unsigned long long *map, unsigned dtype, unsigned rank,
                                    void *addr, const unsigned long long *dims,
                                    const unsigned long long *strides, int lower, int upper,
                                    unsigned channels, unsigned pixels, const unsigned *estrides,
                                    unsigned interleave, unsigned mode, unsigned swizzle,
                                    unsigned l2, unsigned oob) {
    if (rank < 3 || mode > 1) return INVALID_VALUE;
    static const unsigned ones[5] = {1, 1, 1, 1, 1};
    CUresult r = do_tmap_encode(map, dtype, rank, addr, dims, strides, ones, estrides, interleave,
                                swizzle, l2, oob);
    if (r) return r;
    map[11] = 0;
    map[12] &= ~0xffffull;
    map[13] = (unsigned long long)((unsigned)lower & 0xffff);
    map[14] = (unsigned long long)((unsigned)upper & 0xffff);
    map[15] = (2 | (mode << 4)) | ((unsigned long long)(channels & 0xffffff) << 8) |
              ((unsigned long long)pixels << 32);
    return SUCCESS;
}
EXPORT CUresult cuTensorMapEncodeIm2colWide(unsigned long long *map, unsigned dtype, unsigned rank,
                                            void *addr, const unsigned long long *dims,
                                            const unsigned long long *strides, int lower,
                                            int upper, unsigned channels, unsigned pixels,
                                            const unsigned *estrides, unsigned interleave,
                                            unsigned mode, unsigned swizzle, unsigned l2,
                                            unsigned oob) {
    LOCKED(do_tmap_im2col_wide(map, dtype, rank, addr, dims, strides, lower, upper, channels,
                               pixels, estrides, interleave, mode, swizzle, l2, oob));
}
static CUresult do_tmap_replace(unsigned long long *map, void *addr) {
    if (!map || ((uintptr_t)map % 64) || (map[0] & 0xffffffffull) != TMAP_MAGIC) return INVALID_VALUE;
    map[1] = (unsigned long long)(uintptr_t)addr;
    return SUCCESS;
}
EXPORT CUresult cuTensorMapReplaceAddress(unsigned long long *map, void *addr) {
    LOCKED(do_tmap_replace(map, addr));
}
#endif

/* ---- green contexts (CUDA 12.4+) ------------------------------------------ */
/* CUdevResource as the header lays it out: type, 92 bytes of padding, then the
 * SM fields (smCount, minSmPartitionSize, smCoscheduledAlignment), 144 bytes. */
struct dev_resource {
    unsigned type;
    unsigned char pad[92];
    unsigned sm_count, min_partition, alignment;
    unsigned char rest[36];
};
struct green {
    int dev;
    unsigned sms;
};
struct desc {
    unsigned sms;
};
EXPORT long fakecuda_green_orphans(void) { return green_orphans; }
/* The green context a stream was made on, or NULL. */
EXPORT void *fakecuda_stream_green(void *s) {
    pthread_mutex_lock(&lock);
    void *g = find(s, K_STREAM) ? ((struct stream *)s)->green : NULL;
    pthread_mutex_unlock(&lock);
    return g;
}
#ifndef FAKECUDA_OLD
static void sm_resource(struct dev_resource *r, unsigned sms) {
    memset(r, 0, sizeof *r);
    r->type = 1;
    r->sm_count = sms;
    r->min_partition = 8;
    r->alignment = 8;
}
static CUresult do_dev_resource(int dev, struct dev_resource *r, unsigned type) {
    NEED_INIT();
    NEED_DEV(dev);
    if (!r || type != 1) return INVALID_VALUE;
    /* A multiprocessor count set by fakecuda_set_attribute (16) is the device's
     * SM count here too (a test can ask for a huge one). */
    sm_resource(r, attr_overridden[dev][16] ? (unsigned)attr_override[dev][16] : dev == 0 ? 132 : 66);
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetDevResource(int dev, struct dev_resource *r, unsigned type) {
    LOCKED(do_dev_resource(dev, r, type));
}
static CUresult do_split(struct dev_resource *result, unsigned *groups, const struct dev_resource *in,
                         struct dev_resource *remaining, unsigned flags, unsigned min_count) {
    NEED_INIT();
    if (!groups || !in || in->type != 1 || flags > 3) return INVALID_VALUE;
    unsigned count = min_count < 8 ? 8 : (min_count + 7) / 8 * 8;
    if (count > in->sm_count) return INVALID_VALUE; /* CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION in 13.0 */
    unsigned n = in->sm_count / count;
    if (result && *groups < n) n = *groups;
    if (result && n == 0) return INVALID_VALUE;
    for (unsigned i = 0; result && i < n; i++) sm_resource(&result[i], count);
    if (remaining) sm_resource(remaining, in->sm_count - n * count);
    *groups = n;
    return SUCCESS;
}
EXPORT CUresult cuDevSmResourceSplitByCount(struct dev_resource *result, unsigned *groups,
                                            const struct dev_resource *in,
                                            struct dev_resource *remaining, unsigned flags,
                                            unsigned min_count) {
    LOCKED(do_split(result, groups, in, remaining, flags, min_count));
}
static CUresult do_gen_desc(void **desc, struct dev_resource *r, unsigned n) {
    NEED_INIT();
    if (!desc || !r || n == 0) return INVALID_VALUE;
    struct desc *d = calloc(1, sizeof *d);
    for (unsigned i = 0; i < n; i++) {
        if (r[i].type != 1) { free(d); return INVALID_VALUE; }
        d->sms += r[i].sm_count;
    }
    track(d, K_DESC, 0, -1);
    *desc = d;
    return SUCCESS;
}
EXPORT CUresult cuDevResourceGenerateDesc(void **desc, struct dev_resource *r, unsigned n) {
    LOCKED(do_gen_desc(desc, r, n));
}
static CUresult do_green_create(void **g, void *desc, int dev, unsigned flags) {
    NEED_INIT();
    NEED_DEV(dev);
    if (!g || flags != 1) return INVALID_VALUE;
    if (!find(desc, K_DESC)) return INVALID_VALUE;
    struct green *gc = calloc(1, sizeof *gc);
    gc->dev = dev;
    gc->sms = ((struct desc *)desc)->sms;
    track(gc, K_GREEN, 0, dev);
    *g = gc;
    return SUCCESS;
}
EXPORT CUresult cuGreenCtxCreate(void **g, void *desc, int dev, unsigned flags) {
    LOCKED(do_green_create(g, desc, dev, flags));
}
static CUresult do_green_destroy(void *g) {
    struct handle *h = find(g, K_GREEN);
    if (!h) return INVALID_HANDLE;
    for (int i = 0; i < TABLE; i++)
        if (handles[i].kind == K_STREAM && ((struct stream *)handles[i].p)->green == g) green_orphans++;
    untrack(h);
    free(g);
    return SUCCESS;
}
EXPORT CUresult cuGreenCtxDestroy(void *g) { LOCKED(do_green_destroy(g)); }
static CUresult do_green_resource(void *g, struct dev_resource *r, unsigned type) {
    if (!find(g, K_GREEN)) return INVALID_HANDLE;
    if (!r || type != 1) return INVALID_VALUE;
    sm_resource(r, ((struct green *)g)->sms);
    return SUCCESS;
}
EXPORT CUresult cuGreenCtxGetDevResource(void *g, struct dev_resource *r, unsigned type) {
    LOCKED(do_green_resource(g, r, type));
}
static CUresult do_green_stream(void **s, void *g, unsigned flags, int priority) {
    if (!find(g, K_GREEN)) return INVALID_HANDLE;
    if (!s || !(flags & 1)) return INVALID_VALUE; /* CU_STREAM_NON_BLOCKING is required */
    struct ctx *primary = &primaries[((struct green *)g)->dev];
    if (!primary->alive) return INVALID_CONTEXT;
    if (priority > 0) priority = 0;
    if (priority < -5) priority = -5;
    struct stream *st = calloc(1, sizeof *st);
    st->ctx = primary;
    st->green = g;
    st->flags = flags;
    st->priority = priority;
    *s = st;
    track(st, K_STREAM, 0, primary->dev);
    return SUCCESS;
}
EXPORT CUresult cuGreenCtxStreamCreate(void **s, void *g, unsigned flags, int priority) {
    LOCKED(do_green_stream(s, g, flags, priority));
}
#endif
