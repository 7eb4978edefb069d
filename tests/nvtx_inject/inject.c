/*
 * kvverify NVTX recorder: a minimal NVTX injection library for tests.
 *
 * NVTX (v3, header-only) looks for a tool at the first NVTX call of each
 * NVTX instance in the process: it dlopen()s the library named by the
 * environment variable NVTX_INJECTION64_PATH and calls its
 * `InitializeInjectionNvtx2`.  That is how Nsight Systems sees NVTX ranges.
 * This library attaches the same way and writes one JSON object per line,
 * per event, to the file named by KVVERIFY_NVTX_LOG (stderr if unset):
 *
 *   {"seq":N,"pid":P,"tid":T,"t_ns":..,"ev":"push","domain":"kvverify",
 *    "message":"H1 store/D2H/ANY/pinned/adversarial","category":1,
 *    "category_name":"store","color":"0xff0072b2","payload_type":"int64",
 *    "payload":3,"level":1}
 *
 * ev is one of: init, ext_init, domain_create, domain_destroy,
 * register_string, name_category, name_thread, push, pop, start, end, mark.
 * push: level is the nesting depth of this thread in this domain before the
 * push (0 for an outermost range), as NVTX defines the return value.
 * pop: level is the depth after the pop, -1 for a pop with no open push.
 * start/end: id is the range id (process-wide, unique).
 *
 * Hooked callbacks (NvtxExportTableCallbacks::GetModuleFunctionTable):
 *   CORE:  MarkEx MarkA RangeStartEx RangeStartA RangeEnd RangePushEx
 *          RangePushA RangePop NameCategoryA NameOsThreadA
 *   CORE2: DomainMarkEx DomainRangeStartEx DomainRangeEnd DomainRangePushEx
 *          DomainRangePop DomainNameCategoryA DomainRegisterStringA
 *          DomainRegisterStringW DomainCreateA DomainCreateW DomainDestroy
 *          Initialize
 * plus the payload extension's nvtxDomainIsEnabled (through
 * InitializeInjectionNvtxExtension), so that the `nvtx` Python package sees
 * its domains as enabled.
 *
 * Build (tests/nvtx_support.py does this):
 *   cc -shared -fPIC -O2 -I<dir holding nvtx3/> inject.c -o libkvnvtxrec.so -lpthread
 */
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtPayload.h>

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <wchar.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- registries (never freed: handles must stay valid for the process) ---- */

typedef struct category_st {
    uint32_t id;
    char *name;
    struct category_st *next;
} category_t;

typedef struct domain_st {
    char *name;
    category_t *categories;
    struct domain_st *next;
} domain_t;

typedef struct string_st {
    domain_t *domain;
    char *text;
} string_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static domain_t g_default_domain = {"", NULL, NULL}; /* the NULL handle */
static domain_t *g_domains = NULL;
static int g_fd = -1;
static uint64_t g_seq = 0;
static uint64_t g_next_range_id = 1;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void open_log(void)
{
    const char *path = getenv("KVVERIFY_NVTX_LOG");
    if (path && *path) {
        g_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    }
    if (g_fd < 0) {
        g_fd = 2;
    }
}

static domain_t *dom(nvtxDomainHandle_t h)
{
    return h ? (domain_t *)h : &g_default_domain;
}

/* ---- per-thread push/pop depth, per domain ---- */

#define MAX_TL_DOMAINS 64
typedef struct {
    const domain_t *domain;
    int depth;
} depth_t;
static __thread depth_t tl_depth[MAX_TL_DOMAINS];
static __thread int tl_ndepth = 0;

static int *depth_of(const domain_t *d)
{
    for (int i = 0; i < tl_ndepth; ++i) {
        if (tl_depth[i].domain == d) {
            return &tl_depth[i].depth;
        }
    }
    if (tl_ndepth < MAX_TL_DOMAINS) {
        tl_depth[tl_ndepth].domain = d;
        tl_depth[tl_ndepth].depth = 0;
        return &tl_depth[tl_ndepth++].depth;
    }
    static __thread int overflow;
    return &overflow;
}

/* ---- JSON line writer ---- */

typedef struct {
    char buf[16384];
    size_t n;
} line_t;

static void put(line_t *l, const char *s)
{
    size_t k = strlen(s);
    if (l->n + k >= sizeof(l->buf) - 4) {
        k = sizeof(l->buf) - 4 - l->n;
    }
    memcpy(l->buf + l->n, s, k);
    l->n += k;
}

static void putf(line_t *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(line_t *l, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    put(l, tmp);
}

static void put_json_char(line_t *l, unsigned int c)
{
    char tmp[16];
    switch (c) {
    case '"': put(l, "\\\""); return;
    case '\\': put(l, "\\\\"); return;
    case '\n': put(l, "\\n"); return;
    case '\r': put(l, "\\r"); return;
    case '\t': put(l, "\\t"); return;
    default: break;
    }
    if (c < 0x20 || (c >= 0x7f && c < 0x80)) {
        snprintf(tmp, sizeof tmp, "\\u%04x", c);
        put(l, tmp);
    } else if (c < 0x80) {
        tmp[0] = (char)c;
        tmp[1] = 0;
        put(l, tmp);
    } else if (c < 0x10000) {
        snprintf(tmp, sizeof tmp, "\\u%04x", c);
        put(l, tmp);
    } else {
        c -= 0x10000;
        snprintf(tmp, sizeof tmp, "\\u%04x\\u%04x", 0xd800 + (c >> 10), 0xdc00 + (c & 0x3ff));
        put(l, tmp);
    }
}

/* UTF-8 bytes are passed through (JSON allows them); control bytes escaped. */
static void put_str(line_t *l, const char *key, const char *s)
{
    putf(l, ",\"%s\":", key);
    if (!s) {
        put(l, "null");
        return;
    }
    put(l, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p && l->n < sizeof(l->buf) - 64; ++p) {
        if (*p >= 0x80) {
            char tmp[2] = {(char)*p, 0};
            put(l, tmp);
        } else {
            put_json_char(l, *p);
        }
    }
    put(l, "\"");
}

static void put_wstr(line_t *l, const char *key, const wchar_t *s)
{
    putf(l, ",\"%s\":", key);
    if (!s) {
        put(l, "null");
        return;
    }
    put(l, "\"");
    for (; *s && l->n < sizeof(l->buf) - 64; ++s) {
        put_json_char(l, (unsigned int)*s);
    }
    put(l, "\"");
}

/* Starts a line; the caller holds g_lock. */
static void begin(line_t *l, const char *ev, const domain_t *d)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    l->n = 0;
    putf(l, "{\"seq\":%llu,\"pid\":%ld,\"tid\":%ld,\"t_ns\":%llu,\"ev\":\"%s\"",
         (unsigned long long)++g_seq, (long)getpid(), (long)syscall(SYS_gettid),
         (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec, ev);
    if (d) {
        put_str(l, "domain", d->name);
    }
}

static void finish(line_t *l)
{
    put(l, "}\n");
    size_t off = 0;
    while (off < l->n) {
        ssize_t w = write(g_fd, l->buf + off, l->n - off);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            break;
        }
        off += (size_t)w;
    }
}

static const char *category_name(const domain_t *d, uint32_t id)
{
    for (const category_t *c = d->categories; c; c = c->next) {
        if (c->id == id) {
            return c->name;
        }
    }
    return NULL;
}

static void put_attributes(line_t *l, const domain_t *d, const nvtxEventAttributes_t *a)
{
    if (!a) {
        put(l, ",\"message\":null");
        return;
    }
    switch (a->messageType) {
    case NVTX_MESSAGE_TYPE_ASCII:
        put_str(l, "message", a->message.ascii);
        break;
    case NVTX_MESSAGE_TYPE_UNICODE:
        put_wstr(l, "message", a->message.unicode);
        break;
    case NVTX_MESSAGE_TYPE_REGISTERED: {
        const string_t *s = (const string_t *)a->message.registered;
        put_str(l, "message", s ? s->text : NULL);
        put(l, ",\"message_registered\":true");
        break;
    }
    default:
        put(l, ",\"message\":null");
        break;
    }
    putf(l, ",\"category\":%u", (unsigned)a->category);
    if (a->category) {
        put_str(l, "category_name", category_name(d, a->category));
    } else {
        put(l, ",\"category_name\":null");
    }
    if (a->colorType == NVTX_COLOR_ARGB) {
        putf(l, ",\"color\":\"0x%08x\"", (unsigned)a->color);
    } else {
        put(l, ",\"color\":null");
    }
    switch (a->payloadType) {
    case NVTX_PAYLOAD_TYPE_UNSIGNED_INT64:
        putf(l, ",\"payload_type\":\"uint64\",\"payload\":%llu", (unsigned long long)a->payload.ullValue);
        break;
    case NVTX_PAYLOAD_TYPE_INT64:
        putf(l, ",\"payload_type\":\"int64\",\"payload\":%lld", (long long)a->payload.llValue);
        break;
    case NVTX_PAYLOAD_TYPE_DOUBLE:
        putf(l, ",\"payload_type\":\"double\",\"payload\":%.17g", a->payload.dValue);
        break;
    case NVTX_PAYLOAD_TYPE_UNSIGNED_INT32:
        putf(l, ",\"payload_type\":\"uint32\",\"payload\":%u", a->payload.uiValue);
        break;
    case NVTX_PAYLOAD_TYPE_INT32:
        putf(l, ",\"payload_type\":\"int32\",\"payload\":%d", a->payload.iValue);
        break;
    case NVTX_PAYLOAD_TYPE_FLOAT:
        putf(l, ",\"payload_type\":\"float\",\"payload\":%.9g", (double)a->payload.fValue);
        break;
    case NVTX_PAYLOAD_TYPE_EXT:
        put(l, ",\"payload_type\":\"ext\",\"payload\":null");
        break;
    default:
        put(l, ",\"payload_type\":null,\"payload\":null");
        break;
    }
}

/* ---- event recorders ---- */

static void record_attr_event(const char *ev, nvtxDomainHandle_t h, const nvtxEventAttributes_t *a,
                              int level, uint64_t id)
{
    line_t l;
    const domain_t *d = dom(h);
    pthread_mutex_lock(&g_lock);
    begin(&l, ev, d);
    put_attributes(&l, d, a);
    if (level != -1000) {
        putf(&l, ",\"level\":%d", level);
    }
    if (id) {
        putf(&l, ",\"id\":%llu", (unsigned long long)id);
    }
    finish(&l);
    pthread_mutex_unlock(&g_lock);
}

static nvtxEventAttributes_t ascii_attributes(const char *message)
{
    nvtxEventAttributes_t a;
    memset(&a, 0, sizeof a);
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = message;
    return a;
}

/* CORE2 (domain) callbacks */

static void NVTX_API cb_DomainMarkEx(nvtxDomainHandle_t h, const nvtxEventAttributes_t *a)
{
    record_attr_event("mark", h, a, -1000, 0);
}

static nvtxRangeId_t NVTX_API cb_DomainRangeStartEx(nvtxDomainHandle_t h, const nvtxEventAttributes_t *a)
{
    uint64_t id = __sync_fetch_and_add(&g_next_range_id, 1);
    record_attr_event("start", h, a, -1000, id);
    return id;
}

static void NVTX_API cb_DomainRangeEnd(nvtxDomainHandle_t h, nvtxRangeId_t id)
{
    line_t l;
    pthread_mutex_lock(&g_lock);
    begin(&l, "end", dom(h));
    putf(&l, ",\"id\":%llu", (unsigned long long)id);
    finish(&l);
    pthread_mutex_unlock(&g_lock);
}

static int NVTX_API cb_DomainRangePushEx(nvtxDomainHandle_t h, const nvtxEventAttributes_t *a)
{
    int *depth = depth_of(dom(h));
    int level = (*depth)++;
    record_attr_event("push", h, a, level, 0);
    return level;
}

static int NVTX_API cb_DomainRangePop(nvtxDomainHandle_t h)
{
    int *depth = depth_of(dom(h));
    int level = *depth > 0 ? --(*depth) : -1;
    line_t l;
    pthread_mutex_lock(&g_lock);
    begin(&l, "pop", dom(h));
    putf(&l, ",\"level\":%d", level);
    finish(&l);
    pthread_mutex_unlock(&g_lock);
    return level;
}

static void NVTX_API cb_DomainNameCategoryA(nvtxDomainHandle_t h, uint32_t id, const char *name)
{
    domain_t *d = dom(h);
    line_t l;
    pthread_mutex_lock(&g_lock);
    category_t *c = NULL;
    for (category_t *p = d->categories; p; p = p->next) {
        if (p->id == id) {
            c = p;
        }
    }
    if (!c) {
        c = calloc(1, sizeof *c);
        if (c) {
            c->id = id;
            c->next = d->categories;
            d->categories = c;
        }
    }
    if (c) {
        free(c->name);
        c->name = strdup(name ? name : "");
    }
    begin(&l, "name_category", d);
    putf(&l, ",\"category\":%u", (unsigned)id);
    put_str(&l, "name", name);
    finish(&l);
    pthread_mutex_unlock(&g_lock);
}

static nvtxStringHandle_t register_string(nvtxDomainHandle_t h, char *text)
{
    string_t *s = calloc(1, sizeof *s);
    line_t l;
    if (!s || !text) {
        free(s);
        free(text);
        return NULL;
    }
    s->domain = dom(h);
    s->text = text;
    pthread_mutex_lock(&g_lock);
    begin(&l, "register_string", s->domain);
    put_str(&l, "string", text);
    finish(&l);
    pthread_mutex_unlock(&g_lock);
    return (nvtxStringHandle_t)s;
}

static char *wide_to_utf8(const wchar_t *w)
{
    size_t n = w ? wcslen(w) : 0;
    char *out = malloc(4 * n + 1);
    size_t k = 0;
    if (!out) {
        return NULL;
    }
    for (size_t i = 0; i < n; ++i) {
        unsigned int c = (unsigned int)w[i];
        if (c < 0x80) {
            out[k++] = (char)c;
        } else if (c < 0x800) {
            out[k++] = (char)(0xc0 | (c >> 6));
            out[k++] = (char)(0x80 | (c & 0x3f));
        } else if (c < 0x10000) {
            out[k++] = (char)(0xe0 | (c >> 12));
            out[k++] = (char)(0x80 | ((c >> 6) & 0x3f));
            out[k++] = (char)(0x80 | (c & 0x3f));
        } else {
            out[k++] = (char)(0xf0 | (c >> 18));
            out[k++] = (char)(0x80 | ((c >> 12) & 0x3f));
            out[k++] = (char)(0x80 | ((c >> 6) & 0x3f));
            out[k++] = (char)(0x80 | (c & 0x3f));
        }
    }
    out[k] = 0;
    return out;
}

static nvtxStringHandle_t NVTX_API cb_DomainRegisterStringA(nvtxDomainHandle_t h, const char *s)
{
    return register_string(h, strdup(s ? s : ""));
}

static nvtxStringHandle_t NVTX_API cb_DomainRegisterStringW(nvtxDomainHandle_t h, const wchar_t *s)
{
    return register_string(h, wide_to_utf8(s));
}

static nvtxDomainHandle_t create_domain(char *name)
{
    domain_t *d;
    line_t l;
    if (!name) {
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    for (d = g_domains; d; d = d->next) {
        if (strcmp(d->name, name) == 0) {
            break;
        }
    }
    if (!d) {
        d = calloc(1, sizeof *d);
        if (d) {
            d->name = name;
            d->next = g_domains;
            g_domains = d;
            name = NULL;
        }
    }
    free(name);
    if (d) {
        begin(&l, "domain_create", d);
        finish(&l);
    }
    pthread_mutex_unlock(&g_lock);
    return (nvtxDomainHandle_t)d;
}

static nvtxDomainHandle_t NVTX_API cb_DomainCreateA(const char *name)
{
    return create_domain(strdup(name ? name : ""));
}

static nvtxDomainHandle_t NVTX_API cb_DomainCreateW(const wchar_t *name)
{
    return create_domain(wide_to_utf8(name));
}

static void NVTX_API cb_DomainDestroy(nvtxDomainHandle_t h)
{
    /* Handles stay valid: other NVTX instances in the process may share them. */
    line_t l;
    pthread_mutex_lock(&g_lock);
    begin(&l, "domain_destroy", dom(h));
    finish(&l);
    pthread_mutex_unlock(&g_lock);
}

static void NVTX_API cb_Initialize(const void *reserved)
{
    (void)reserved;
}

/* CORE (default domain) callbacks */

static void NVTX_API cb_MarkEx(const nvtxEventAttributes_t *a) { cb_DomainMarkEx(NULL, a); }
static void NVTX_API cb_MarkA(const char *m)
{
    nvtxEventAttributes_t a = ascii_attributes(m);
    cb_DomainMarkEx(NULL, &a);
}
static nvtxRangeId_t NVTX_API cb_RangeStartEx(const nvtxEventAttributes_t *a) { return cb_DomainRangeStartEx(NULL, a); }
static nvtxRangeId_t NVTX_API cb_RangeStartA(const char *m)
{
    nvtxEventAttributes_t a = ascii_attributes(m);
    return cb_DomainRangeStartEx(NULL, &a);
}
static void NVTX_API cb_RangeEnd(nvtxRangeId_t id) { cb_DomainRangeEnd(NULL, id); }
static int NVTX_API cb_RangePushEx(const nvtxEventAttributes_t *a) { return cb_DomainRangePushEx(NULL, a); }
static int NVTX_API cb_RangePushA(const char *m)
{
    nvtxEventAttributes_t a = ascii_attributes(m);
    return cb_DomainRangePushEx(NULL, &a);
}
static int NVTX_API cb_RangePop(void) { return cb_DomainRangePop(NULL); }
static void NVTX_API cb_NameCategoryA(uint32_t id, const char *name) { cb_DomainNameCategoryA(NULL, id, name); }
static void NVTX_API cb_NameOsThreadA(uint32_t tid, const char *name)
{
    line_t l;
    pthread_mutex_lock(&g_lock);
    begin(&l, "name_thread", NULL);
    putf(&l, ",\"thread\":%u", (unsigned)tid);
    put_str(&l, "name", name);
    finish(&l);
    pthread_mutex_unlock(&g_lock);
}

/* ---- attaching ---- */

static int set_slot(NvtxFunctionTable table, unsigned int size, unsigned int cbid, NvtxFunctionPointer fn)
{
    if (cbid >= size || !table[cbid]) {
        return 0;
    }
    *table[cbid] = fn;
    return 1;
}

#define SET(table, size, id, fn) set_slot(table, size, id, (NvtxFunctionPointer)(fn))

EXPORT int NVTX_API InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable)
{
    const NvtxExportTableCallbacks *cbs;
    const NvtxExportTableVersionInfo *version;
    NvtxFunctionTable core = NULL, core2 = NULL;
    unsigned int ncore = 0, ncore2 = 0;
    line_t l;

    pthread_once(&g_once, open_log);
    if (!getExportTable) {
        return 0;
    }
    version = (const NvtxExportTableVersionInfo *)getExportTable(NVTX_ETID_VERSIONINFO);
    if (version && version->struct_size >= sizeof(*version) && version->SetInjectionNvtxVersion) {
        version->SetInjectionNvtxVersion(NVTX_VERSION);
    }
    cbs = (const NvtxExportTableCallbacks *)getExportTable(NVTX_ETID_CALLBACKS);
    if (!cbs || cbs->struct_size < sizeof(*cbs) || !cbs->GetModuleFunctionTable) {
        return 0;
    }
    if (!cbs->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &core, &ncore) || !core) {
        return 0;
    }
    if (!cbs->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &core2, &ncore2) || !core2) {
        return 0;
    }

    SET(core, ncore, NVTX_CBID_CORE_MarkEx, cb_MarkEx);
    SET(core, ncore, NVTX_CBID_CORE_MarkA, cb_MarkA);
    SET(core, ncore, NVTX_CBID_CORE_RangeStartEx, cb_RangeStartEx);
    SET(core, ncore, NVTX_CBID_CORE_RangeStartA, cb_RangeStartA);
    SET(core, ncore, NVTX_CBID_CORE_RangeEnd, cb_RangeEnd);
    SET(core, ncore, NVTX_CBID_CORE_RangePushEx, cb_RangePushEx);
    SET(core, ncore, NVTX_CBID_CORE_RangePushA, cb_RangePushA);
    SET(core, ncore, NVTX_CBID_CORE_RangePop, cb_RangePop);
    SET(core, ncore, NVTX_CBID_CORE_NameCategoryA, cb_NameCategoryA);
    SET(core, ncore, NVTX_CBID_CORE_NameOsThreadA, cb_NameOsThreadA);

    SET(core2, ncore2, NVTX_CBID_CORE2_DomainMarkEx, cb_DomainMarkEx);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainRangeStartEx, cb_DomainRangeStartEx);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainRangeEnd, cb_DomainRangeEnd);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainRangePushEx, cb_DomainRangePushEx);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainRangePop, cb_DomainRangePop);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainNameCategoryA, cb_DomainNameCategoryA);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainRegisterStringA, cb_DomainRegisterStringA);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainRegisterStringW, cb_DomainRegisterStringW);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainCreateA, cb_DomainCreateA);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainCreateW, cb_DomainCreateW);
    SET(core2, ncore2, NVTX_CBID_CORE2_DomainDestroy, cb_DomainDestroy);
    SET(core2, ncore2, NVTX_CBID_CORE2_Initialize, cb_Initialize);

    pthread_mutex_lock(&g_lock);
    begin(&l, "init", NULL);
    putf(&l, ",\"nvtx_version\":%u,\"core_slots\":%u,\"core2_slots\":%u",
         version ? (unsigned)version->version : 0u, ncore, ncore2);
    finish(&l);
    pthread_mutex_unlock(&g_lock);
    return 1; /* non-zero: attached */
}

/* Payload extension: report every domain as enabled (the `nvtx` Python
 * package hands out a no-op DummyDomain for a disabled one). Other
 * extension modules attach nothing; NVTX turns their calls into no-ops. */
static uint8_t NVTX_API cb_DomainIsEnabled(nvtxDomainHandle_t h)
{
    (void)h;
    return 1;
}

EXPORT int NVTX_API InitializeInjectionNvtxExtension(nvtxExtModuleInfo_t *info)
{
    line_t l;
    pthread_once(&g_once, open_log);
    if (!info) {
        return 0;
    }
    if (info->moduleId == NVTX_EXT_PAYLOAD_MODULEID && info->segmentsCount > 0 && info->segments &&
        info->segments[0].slotCount > NVTX3EXT_CBID_nvtxDomainIsEnabled) {
        info->segments[0].functionSlots[NVTX3EXT_CBID_nvtxDomainIsEnabled] = (intptr_t)cb_DomainIsEnabled;
    }
    pthread_mutex_lock(&g_lock);
    begin(&l, "ext_init", NULL);
    putf(&l, ",\"module\":%u", (unsigned)info->moduleId);
    finish(&l);
    pthread_mutex_unlock(&g_lock);
    return 1;
}
