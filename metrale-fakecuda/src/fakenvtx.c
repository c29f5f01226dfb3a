/* A stand-in NVTX tool (injection library) for metrale's tests: it implements
 * the NVTX v3 injection protocol from the tool's side and records every call it
 * receives. The types are declared here by their ABI (no NVTX header is used).
 *
 * InitializeInjectionNvtx2 asks for the callbacks export table, the version-info
 * table (and says it implements version 3), and the CORE, CORE2 and CUDA module
 * tables, and writes its recorders into them. Built with -DFAKENVTX_FAIL it
 * writes them too but returns 0, a tool that failed to initialise: the caller
 * must then call none of them.
 *
 * Built with -DFAKENVTX_HOSTILE it is a hostile tool: during its init it asks
 * for tables with null out-pointers, unknown (negative, huge) module ids and
 * unknown export-table ids, runs the hook a test set (a call back into the
 * process, whose NVTX calls land while the tool is attaching), fills the
 * tables and then clears the CORE mark entries (a tool may leave any entry
 * null); after its init, each push asks for the CORE table again and writes a
 * different pop into it (a write the caller must not see). Surprises (a
 * refusal that was not one) are counted in fakenvtx_hostile_surprises.
 *
 * Tests read the records through the fakenvtx_* exports. */

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef void (*fn_ptr)(void);
typedef fn_ptr **fn_table;

typedef struct {
    size_t struct_size;
    int (*get_module_function_table)(int module, fn_table *out_table, unsigned *out_size);
} callbacks_table;

typedef struct {
    size_t struct_size;
    uint32_t version;
    uint32_t reserved0;
    void (*set_injection_version)(uint32_t version);
} version_table;

typedef const void *(*get_export_table_fn)(uint32_t id);

typedef struct {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    union {
        uint64_t u64;
        int64_t i64;
        double f64;
        uint32_t u32;
        int32_t i32;
        float f32;
    } payload;
    int32_t message_type;
    union {
        const char *ascii;
        const void *unicode;
        const void *registered;
    } message;
} event_attributes;

enum {
    K_MARK = 1,
    K_RANGE_START = 2,
    K_RANGE_END = 3,
    K_PUSH = 4,
    K_POP = 5,
    K_NAME_CATEGORY = 6,
    K_NAME_THREAD = 7,
    K_DOMAIN_CREATE = 8,
    K_DOMAIN_DESTROY = 9,
    K_REGISTER_STRING = 10,
    K_NAME_DEVICE = 11,
    K_NAME_CONTEXT = 12,
    K_NAME_STREAM = 13,
    K_NAME_EVENT = 14,
};

/* One call received; the Rust side declares the same layout (NvtxRecord). */
typedef struct {
    int32_t kind;
    int32_t level;     /* what a push or pop returned */
    uint64_t domain;   /* the domain handle, 0 for the core calls */
    uint64_t handle;   /* range id, thread id, device, context, stream, event */
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    uint64_t payload;  /* the union's 8 bytes */
    int32_t message_type;
    int32_t attributes_size; /* the size field of the attributes, 0 without */
    char message[120];
} record;

#define MAX_RECORDS 4096

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static record records[MAX_RECORDS];
static int64_t count;          /* every call, also those past MAX_RECORDS */
static uint64_t next_range = 1;
static int inits;
static uint32_t app_version;
static int module_sizes[8];

/* Nesting depth of push/pop, per thread and per domain (slot 0: the core);
 * the domain table is read and written under `lock`. */
#define MAX_DOMAINS 32
static __thread int depth[MAX_DOMAINS + 1];

typedef struct {
    char name[120];
} named;

static named *domains[MAX_DOMAINS];
static int domain_count;

static int domain_index(const void *domain) {
    if (!domain) return 0;
    for (int i = 0; i < domain_count; i++)
        if (domains[i] == domain) return i + 1;
    return -1;
}

static void copy_text(char *to, const char *from) {
    if (!from) {
        to[0] = 0;
        return;
    }
    strncpy(to, from, 119);
    to[119] = 0;
}

static record *push_record(int kind) {
    record *r = NULL;
    if (count < MAX_RECORDS) {
        r = &records[count];
        memset(r, 0, sizeof *r);
        r->kind = kind;
    }
    count++;
    return r;
}

static void fill_attributes(record *r, const event_attributes *a) {
    if (!r || !a) return;
    r->attributes_size = a->size;
    r->category = a->category;
    r->color_type = a->color_type;
    r->color = a->color;
    r->payload_type = a->payload_type;
    memcpy(&r->payload, &a->payload, sizeof r->payload);
    r->message_type = a->message_type;
    if (a->message_type == 1) {
        copy_text(r->message, a->message.ascii);
    } else if (a->message_type == 3) {
        copy_text(r->message, a->message.registered ? ((const named *)a->message.registered)->name : NULL);
    }
}

static void simple(int kind, const void *domain, uint64_t handle, const char *text) {
    pthread_mutex_lock(&lock);
    record *r = push_record(kind);
    if (r) {
        r->domain = (uint64_t)(uintptr_t)domain;
        r->handle = handle;
        copy_text(r->message, text);
    }
    pthread_mutex_unlock(&lock);
}

/* ---- CORE ---- */

static void mark_ex(const event_attributes *a) {
    pthread_mutex_lock(&lock);
    fill_attributes(push_record(K_MARK), a);
    pthread_mutex_unlock(&lock);
}

static void mark_a(const char *m) { simple(K_MARK, NULL, 0, m); }

static uint64_t range_start(const void *domain, const event_attributes *a, const char *m) {
    pthread_mutex_lock(&lock);
    uint64_t id = next_range++;
    record *r = push_record(K_RANGE_START);
    if (r) {
        r->domain = (uint64_t)(uintptr_t)domain;
        r->handle = id;
        if (a) fill_attributes(r, a); else copy_text(r->message, m);
    }
    pthread_mutex_unlock(&lock);
    return id;
}

static uint64_t range_start_ex(const event_attributes *a) { return range_start(NULL, a, NULL); }
static uint64_t range_start_a(const char *m) { return range_start(NULL, NULL, m); }
static void range_end(uint64_t id) { simple(K_RANGE_END, NULL, id, NULL); }

static int push(const void *domain, const event_attributes *a, const char *m) {
    pthread_mutex_lock(&lock);
    int d = domain_index(domain);
    int level = d < 0 ? -1 : depth[d]++;
    record *r = push_record(K_PUSH);
    if (r) {
        r->domain = (uint64_t)(uintptr_t)domain;
        r->level = level;
        if (a) fill_attributes(r, a); else copy_text(r->message, m);
    }
    pthread_mutex_unlock(&lock);
    return level;
}

static int pop(const void *domain) {
    pthread_mutex_lock(&lock);
    int d = domain_index(domain);
    int level = d < 0 ? -1 : depth[d] > 0 ? --depth[d] : -1;
    record *r = push_record(K_POP);
    if (r) {
        r->domain = (uint64_t)(uintptr_t)domain;
        r->level = level;
    }
    pthread_mutex_unlock(&lock);
    return level;
}

#ifdef FAKENVTX_HOSTILE
static void late_write(void);
static int push_ex(const event_attributes *a) { late_write(); return push(NULL, a, NULL); }
static int push_a(const char *m) { late_write(); return push(NULL, NULL, m); }
#else
static int push_ex(const event_attributes *a) { return push(NULL, a, NULL); }
static int push_a(const char *m) { return push(NULL, NULL, m); }
#endif
static int pop_core(void) { return pop(NULL); }

static void name_category(uint32_t category, const char *name) {
    pthread_mutex_lock(&lock);
    record *r = push_record(K_NAME_CATEGORY);
    if (r) {
        r->category = category;
        copy_text(r->message, name);
    }
    pthread_mutex_unlock(&lock);
}

static void name_thread(uint32_t tid, const char *name) { simple(K_NAME_THREAD, NULL, tid, name); }

/* ---- CORE2 ---- */

static void domain_mark_ex(const void *domain, const event_attributes *a) {
    pthread_mutex_lock(&lock);
    record *r = push_record(K_MARK);
    if (r) r->domain = (uint64_t)(uintptr_t)domain;
    fill_attributes(r, a);
    pthread_mutex_unlock(&lock);
}

static uint64_t domain_range_start_ex(const void *domain, const event_attributes *a) {
    return range_start(domain, a, NULL);
}

static void domain_range_end(const void *domain, uint64_t id) { simple(K_RANGE_END, domain, id, NULL); }
static int domain_push_ex(const void *domain, const event_attributes *a) { return push(domain, a, NULL); }
static int domain_pop(const void *domain) { return pop(domain); }

static void domain_name_category(const void *domain, uint32_t category, const char *name) {
    pthread_mutex_lock(&lock);
    record *r = push_record(K_NAME_CATEGORY);
    if (r) {
        r->domain = (uint64_t)(uintptr_t)domain;
        r->category = category;
        copy_text(r->message, name);
    }
    pthread_mutex_unlock(&lock);
}

static const void *domain_register_string(const void *domain, const char *text) {
    named *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    copy_text(s->name, text);
    simple(K_REGISTER_STRING, domain, (uint64_t)(uintptr_t)s, text);
    return s;
}

static const void *domain_create(const char *name) {
    pthread_mutex_lock(&lock);
    named *d = NULL;
    if (domain_count < MAX_DOMAINS && (d = calloc(1, sizeof *d))) {
        copy_text(d->name, name);
        domains[domain_count++] = d;
    }
    record *r = push_record(K_DOMAIN_CREATE);
    if (r) {
        r->domain = (uint64_t)(uintptr_t)d;
        copy_text(r->message, name);
    }
    pthread_mutex_unlock(&lock);
    return d;
}

static void domain_destroy(const void *domain) { simple(K_DOMAIN_DESTROY, domain, 0, NULL); }

/* ---- CUDA ---- */

static void name_device(int device, const char *name) { simple(K_NAME_DEVICE, NULL, (uint64_t)device, name); }
static void name_context(void *c, const char *name) { simple(K_NAME_CONTEXT, NULL, (uint64_t)(uintptr_t)c, name); }
static void name_stream(void *s, const char *name) { simple(K_NAME_STREAM, NULL, (uint64_t)(uintptr_t)s, name); }
static void name_event(void *e, const char *name) { simple(K_NAME_EVENT, NULL, (uint64_t)(uintptr_t)e, name); }

/* ---- the protocol ---- */

static void set_entry(fn_table table, unsigned size, unsigned index, fn_ptr f) {
    if (index < size && table[index]) *table[index] = f;
}

#define ENTRY(f) ((fn_ptr)(void (*)(void))(f))

#ifdef FAKENVTX_HOSTILE
static const callbacks_table *kept_cb; /* kept past the init, as a hostile tool may */
static long surprises;
static long redirected_pops;
static void (*init_hook)(void);
EXPORT void fakenvtx_set_init_hook(void (*hook)(void)) { init_hook = hook; }
EXPORT long fakenvtx_hostile_surprises(void) { return surprises; }
EXPORT long fakenvtx_redirected_pops(void) { return redirected_pops; }
static int pop_redirected(void) {
    pthread_mutex_lock(&lock);
    redirected_pops++;
    pthread_mutex_unlock(&lock);
    return -1;
}
/* After the init: ask for the CORE table again and write another pop. */
static void late_write(void) {
    fn_table t = NULL;
    unsigned n = 0;
    if (kept_cb && kept_cb->get_module_function_table(1, &t, &n) && t && n > 11 && t[11])
        *t[11] = (fn_ptr)(void (*)(void))pop_redirected;
}
#endif

EXPORT int InitializeInjectionNvtx2(get_export_table_fn get_export_table) {
    inits++;
    if (!get_export_table) return 0;
    const callbacks_table *cb = get_export_table(1);
    if (!cb || cb->struct_size < sizeof *cb || !cb->get_module_function_table) return 0;
#ifdef FAKENVTX_HOSTILE
    {
        fn_table t = NULL;
        unsigned n = 0;
        /* Null out-pointers: answered without a write through them. */
        cb->get_module_function_table(1, NULL, NULL);
        cb->get_module_function_table(1, &t, NULL);
        cb->get_module_function_table(1, NULL, &n);
        /* Unknown modules: refused, nothing written. */
        t = NULL;
        n = 7;
        if (cb->get_module_function_table(-1, &t, &n) || t || n != 7) surprises++;
        if (cb->get_module_function_table(0x7fffffff, &t, &n) || t || n != 7) surprises++;
        if (cb->get_module_function_table(8, &t, &n) || t || n != 7) surprises++;
        /* Unknown export tables: null. */
        if (get_export_table(0) || get_export_table(0xffffffffu) || get_export_table(4)) surprises++;
        kept_cb = cb;
        if (init_hook) init_hook();
    }
#endif
    const version_table *vi = get_export_table(3);
    if (vi && vi->struct_size >= sizeof *vi) {
        app_version = vi->version;
        if (vi->set_injection_version) vi->set_injection_version(3);
    }
    /* An unknown table id must be answered with null. */
    if (get_export_table(2) || get_export_table(99)) return 0;

    fn_table t;
    unsigned n;
    /* CORE = 1 */
    if (!cb->get_module_function_table(1, &t, &n)) return 0;
    module_sizes[1] = (int)n;
    set_entry(t, n, 1, ENTRY(mark_ex));
    set_entry(t, n, 2, ENTRY(mark_a));
    set_entry(t, n, 4, ENTRY(range_start_ex));
    set_entry(t, n, 5, ENTRY(range_start_a));
    set_entry(t, n, 7, ENTRY(range_end));
    set_entry(t, n, 8, ENTRY(push_ex));
    set_entry(t, n, 9, ENTRY(push_a));
    set_entry(t, n, 11, ENTRY(pop_core));
    set_entry(t, n, 12, ENTRY(name_category));
    set_entry(t, n, 14, ENTRY(name_thread));
    /* CORE2 = 5 */
    if (!cb->get_module_function_table(5, &t, &n)) return 0;
    module_sizes[5] = (int)n;
    set_entry(t, n, 1, ENTRY(domain_mark_ex));
    set_entry(t, n, 2, ENTRY(domain_range_start_ex));
    set_entry(t, n, 3, ENTRY(domain_range_end));
    set_entry(t, n, 4, ENTRY(domain_push_ex));
    set_entry(t, n, 5, ENTRY(domain_pop));
    set_entry(t, n, 8, ENTRY(domain_name_category));
    set_entry(t, n, 10, ENTRY(domain_register_string));
    set_entry(t, n, 12, ENTRY(domain_create));
    set_entry(t, n, 14, ENTRY(domain_destroy));
    /* CUDA = 2 */
    if (!cb->get_module_function_table(2, &t, &n)) return 0;
    module_sizes[2] = (int)n;
    set_entry(t, n, 1, ENTRY(name_device));
    set_entry(t, n, 3, ENTRY(name_context));
    set_entry(t, n, 5, ENTRY(name_stream));
    set_entry(t, n, 7, ENTRY(name_event));
    /* The other modules are served too (sizes only). */
    for (int m = 3; m <= 6; m++) {
        if (m == 5) continue;
        if (!cb->get_module_function_table(m, &t, &n)) return 0;
        module_sizes[m] = (int)n;
    }
    /* An unknown module is refused. */
    if (cb->get_module_function_table(7, &t, &n) || cb->get_module_function_table(0, &t, &n)) return 0;
#ifdef FAKENVTX_HOSTILE
    /* Clear the CORE marks this init filled (entries a tool leaves null). */
    if (cb->get_module_function_table(1, &t, &n)) {
        if (n > 1 && t[1]) *t[1] = NULL;
        if (n > 2 && t[2]) *t[2] = NULL;
    }
#endif
#ifdef FAKENVTX_FAIL
    return 0;
#else
    return 1;
#endif
}

/* ---- what the tests read ---- */

/* Every call received (also those past the record limit). */
EXPORT int64_t fakenvtx_count(void) {
    pthread_mutex_lock(&lock);
    int64_t n = count;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Copy record `i` into `out`; 0 when there is none. */
EXPORT int fakenvtx_record(int64_t i, record *out) {
    pthread_mutex_lock(&lock);
    int ok = i >= 0 && i < count && i < MAX_RECORDS;
    if (ok) *out = records[i];
    pthread_mutex_unlock(&lock);
    return ok;
}

EXPORT size_t fakenvtx_record_size(void) { return sizeof(record); }

/* The calling thread's push depth in `domain` (NULL: the core). */
EXPORT int fakenvtx_depth(const void *domain) {
    pthread_mutex_lock(&lock);
    int d = domain_index(domain);
    int n = d < 0 ? -1 : depth[d];
    pthread_mutex_unlock(&lock);
    return n;
}

/* The name a domain handle was created with ("" for an unknown one). */
EXPORT int fakenvtx_domain_name(const void *domain, char *out, size_t len) {
    pthread_mutex_lock(&lock);
    int d = domain_index(domain);
    int ok = d > 0 && len > 0;
    if (ok) {
        strncpy(out, domains[d - 1]->name, len - 1);
        out[len - 1] = 0;
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

EXPORT int fakenvtx_inits(void) { return inits; }
EXPORT uint32_t fakenvtx_app_version(void) { return app_version; }
EXPORT int fakenvtx_module_size(int module) { return module >= 0 && module < 8 ? module_sizes[module] : -1; }

/* Forget the records (domains, depths and the range counter stay). */
EXPORT void fakenvtx_reset(void) {
    pthread_mutex_lock(&lock);
    count = 0;
    pthread_mutex_unlock(&lock);
}
