/* fp_hook.c - Flashpoint's LD_PRELOAD CUDA-driver hook: time tokens and memory limits.
 * (Memory accounting and its hooks are in fp_mem.c, the sync-point hooks in fp_sync.c;
 * shared declarations in
 * fp_hook_internal.h; the symbol list in hooked_symbols.h.)
 *
 * What it does
 *   - Gates cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel and cuGraphLaunch
 *     (and their _ptsz variants) on a time token from the per-GPU token manager
 *     (flashpoint/gpu/tokens.py).  A token is "you may launch for quota_ns from now".
 *   - Measures usage at sync points (cuCtxSynchronize, cuStreamSynchronize,
 *     cuEventSynchronize, and the synchronous cuMemcpy* copies, which wait for the work
 *     queued before them, as FaST-GShare treats them): the holder's time is wall clock from grant to sync return, and
 *     the token is returned early there (FaST-GShare: an idle/synced tenant frees the GPU).
 *   - Accounts device memory per process (size table keyed by pointer / handle) and
 *     refuses allocations past FP_HOOK_MEM_LIMIT_BYTES with CUDA_ERROR_OUT_OF_MEMORY;
 *     cuMemGetInfo, cuDeviceTotalMem and nvmlDeviceGetMemoryInfo report the same limit.
 *   - Interposes dlsym and cuGetProcAddress(_v2) so runtimes that resolve the driver by
 *     name (the CUDA >= 11.3 runtime, hence torch) still reach these hooks.
 *
 * Environment (read once, at first use)
 *   FP_HOOK_SOCKET              token manager's Unix socket path; unset = no time tokens
 *   FP_HOOK_TENANT              tenant id (uint32), default 0
 *   FP_HOOK_MEM_LIMIT_BYTES     device memory limit of this process; 0/unset = none
 *   FP_HOOK_CONNECT_TIMEOUT_MS  connect/send deadline, default 100
 *   FP_HOOK_GRANT_TIMEOUT_MS    longest wait for a GRANT from a live manager, default 1000
 *   FP_HOOK_RETRY_MS            after a failure: run ungated this long, then reconnect;
 *                               default 1000
 *   FP_HOOK_IDLE_GAP_US         a launch later than token end + this gap means the tenant
 *                               was idle, so the token is charged only up to its last
 *                               launch (never the idle time); default 2000
 *   FP_HOOK_SYNC_ON_EXPIRY      1 (default): at token expiry synchronize the context so the
 *                               reported time includes queued kernels (FaST's overuse);
 *                               also after an idle gap, where a sync that waits shows the
 *                               device was busy all along and the whole time is charged
 *   FP_HOOK_LIBCUDA             driver library to resolve real symbols in, default
 *                               libcuda.so.1 (tests point it at a fake)
 *   FP_HOOK_LIBNVML             default libnvidia-ml.so.1
 *   FP_HOOK_QUIET               1: no stderr log lines
 *
 * Rules kept here (STYLE.md 15): one X-macro list; pre-hook, real call, post-hook only on
 * success; real dlsym found with dlvsym (the private __libc_dlsym vanished in glibc 2.34);
 * real driver symbols from an explicit dlopen("libcuda.so.1") handle, never RTLD_NEXT or
 * our own handle (no recursion into ourselves); exact cu[A-Z] matching so cuBLAS/cuDNN
 * pass untouched; one persistent connection; finite timeouts; on any failure grant and
 * log; never exit().
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fp_protocol.h"
#include "fp_hook_internal.h"

/* ---- X-macro expansions: names, proc names, ptds flags (the enum: fp_hook_internal.h) ---- */
static const char *const fp_sym_name[FP_NSYMS] = {
#define FP_SYM(sym, proc, ptds) #sym,
#include "hooked_symbols.h"
#undef FP_SYM
};
static const char *const fp_sym_proc[FP_NSYMS] = {
#define FP_SYM(sym, proc, ptds) proc,
#include "hooked_symbols.h"
#undef FP_SYM
};
static const unsigned char fp_sym_ptds[FP_NSYMS] = {
#define FP_SYM(sym, proc, ptds) ptds,
#include "hooked_symbols.h"
#undef FP_SYM
};

static void *fp_real_ptr[FP_NSYMS]; /* real functions, filled lazily (atomics) */
static void *fp_hook_ptr(int i);

/* ---- configuration ---- */
struct fp_config fp_cfg;
int fp_quiet;

static uint64_t fp_env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end = NULL;
    unsigned long long x = strtoull(v, &end, 10);
    return (end && *end == '\0') ? (uint64_t)x : dflt;
}

static void tk_after_fork_child(void);
static pthread_once_t fp_cfg_once = PTHREAD_ONCE_INIT;
static void fp_cfg_init(void) {
    const char *s = getenv("FP_HOOK_SOCKET");
    if (s && strlen(s) < sizeof fp_cfg.socket_path) strcpy(fp_cfg.socket_path, s);
    fp_cfg.tenant = (uint32_t)fp_env_u64("FP_HOOK_TENANT", 0);
    fp_cfg.mem_limit = fp_env_u64("FP_HOOK_MEM_LIMIT_BYTES", 0);
    fp_cfg.connect_timeout_ns = fp_env_u64("FP_HOOK_CONNECT_TIMEOUT_MS", 100) * 1000000ull;
    fp_cfg.grant_timeout_ns = fp_env_u64("FP_HOOK_GRANT_TIMEOUT_MS", 1000) * 1000000ull;
    fp_cfg.retry_ns = fp_env_u64("FP_HOOK_RETRY_MS", 1000) * 1000000ull;
    fp_cfg.idle_gap_ns = fp_env_u64("FP_HOOK_IDLE_GAP_US", 2000) * 1000ull;
    fp_cfg.sync_on_expiry = (int)fp_env_u64("FP_HOOK_SYNC_ON_EXPIRY", 1);
    fp_cfg.libcuda = getenv("FP_HOOK_LIBCUDA") ? getenv("FP_HOOK_LIBCUDA") : "libcuda.so.1";
    fp_cfg.libnvml = getenv("FP_HOOK_LIBNVML") ? getenv("FP_HOOK_LIBNVML") : "libnvidia-ml.so.1";
    fp_quiet = (int)fp_env_u64("FP_HOOK_QUIET", 0);
    pthread_atfork(NULL, NULL, tk_after_fork_child);
}
void fp_config(void) { pthread_once(&fp_cfg_once, fp_cfg_init); }

/* ---- the real dlsym and the real driver ---- */
typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn fp_real_dlsym;
static pthread_once_t fp_dlsym_once = PTHREAD_ONCE_INIT;
static void fp_dlsym_init(void) {
    /* dlvsym is not interposed by us, so RTLD_NEXT from here is libc/libdl's dlsym.
     * Versions: x86-64 base, glibc >= 2.34 default, aarch64 base, i386 base. */
    static const char *const versions[] = {"GLIBC_2.2.5", "GLIBC_2.34", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof *versions && !fp_real_dlsym; i++)
        fp_real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}
static dlsym_fn fp_dlsym_real(void) {
    pthread_once(&fp_dlsym_once, fp_dlsym_init);
    return fp_real_dlsym;
}

static void *fp_libcuda, *fp_libnvml;
static pthread_mutex_t fp_lib_mu = PTHREAD_MUTEX_INITIALIZER;

static void *fp_lib_handle(int nvml) {
    fp_config();
    void **slot = nvml ? &fp_libnvml : &fp_libcuda;
    void *h = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (h) return h;
    pthread_mutex_lock(&fp_lib_mu);
    if (!*slot) {
        h = dlopen(nvml ? fp_cfg.libnvml : fp_cfg.libcuda, RTLD_NOW | RTLD_LOCAL);
        if (!h) FP_LOG("cannot dlopen %s: %s", nvml ? fp_cfg.libnvml : fp_cfg.libcuda, dlerror());
        __atomic_store_n(slot, h, __ATOMIC_RELEASE);
    }
    h = *slot;
    pthread_mutex_unlock(&fp_lib_mu);
    return h;
}

/* The real function of hooked symbol i, resolved in the explicit library handle. */
void *fp_real(int i) {
    void *p = __atomic_load_n(&fp_real_ptr[i], __ATOMIC_ACQUIRE);
    if (p) return p;
    dlsym_fn real_dlsym = fp_dlsym_real();
    void *h = fp_lib_handle(strncmp(fp_sym_name[i], "nvml", 4) == 0);
    if (!h || !real_dlsym) return NULL;
    p = real_dlsym(h, fp_sym_name[i]);
    if (p == fp_hook_ptr(i)) p = NULL; /* never call ourselves */
    if (p) __atomic_store_n(&fp_real_ptr[i], p, __ATOMIC_RELEASE);
    return p;
}

/* cuBLAS, cuDNN, cuFFT... start "cu" + lowercase; driver API is exactly "cu[A-Z]". */
static int fp_maybe_ours(const char *name) {
    if (!name) return 0;
    if (name[0] == 'c' && name[1] == 'u' && name[2] >= 'A' && name[2] <= 'Z') return 1;
    return strncmp(name, "nvmlDeviceGetMemoryInfo", 23) == 0;
}
static int fp_find_sym(const char *name) {
    for (int i = 0; i < FP_NSYMS; i++)
        if (strcmp(fp_sym_name[i], name) == 0) return i;
    return -1;
}
static int fp_find_proc(const char *name, int ptds) {
    int fallback = -1;
    for (int i = 0; i < FP_NSYMS; i++) {
        if (!fp_sym_proc[i] || strcmp(fp_sym_proc[i], name) != 0) continue;
        if (fp_sym_ptds[i] == ptds) return i;
        if (!fp_sym_ptds[i]) fallback = i;
    }
    return fallback;
}

/* ======================= time-token client ======================= */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* wakes the releaser thread */
    int fd;               /* -1: not connected */
    uint64_t next_retry;  /* monotonic ns before which we do not reconnect */
    uint64_t seq;
    int have_token, local; /* local: granted by ourselves while the manager is away */
    uint64_t grant, quota, last_launch;
    int launched;
    uint64_t synced_at;   /* last sync return while holding the token; 0 = none pending */
    int failing;          /* logged the current failure episode */
} tk = {.mu = PTHREAD_MUTEX_INITIALIZER, .fd = -1};

static int tk_releaser_started; /* guarded by tk.mu */
static uint64_t fp_cap; /* the manager's cap on this process's device bytes; 0 = none */

/* A forked child (e.g. a data-loader worker) must not talk on its parent's connection or
 * think it holds the parent's token; it reconnects on its first launch.  Its releaser
 * thread did not survive the fork, so it is started again on demand. */
static void tk_after_fork_child(void) {
    pthread_mutex_init(&tk.mu, NULL);
    if (tk.fd >= 0) close(tk.fd);
    tk.fd = -1;
    tk.have_token = tk.local = tk.launched = 0;
    tk.synced_at = tk.next_retry = 0;
    tk_releaser_started = 0;
    __atomic_store_n(&fp_cap, 0, __ATOMIC_RELEASE); /* the child gets its own on connect */
}

static void fp_msg_init(struct fp_msg *m, uint16_t type) {
    memset(m, 0, sizeof *m);
    m->magic = FP_MAGIC;
    m->version = FP_PROTOCOL_VERSION;
    m->type = type;
    m->tenant = fp_cfg.tenant;
    m->pid = (uint32_t)getpid();
}

static void tk_fail(const char *what) { /* caller holds tk.mu */
    if (tk.fd >= 0) close(tk.fd);
    tk.fd = -1;
    tk.next_retry = fp_now_ns() + fp_cfg.retry_ns;
    if (!tk.failing)
        FP_LOG("token manager %s: %s; running ungated, retrying in %llu ms", fp_cfg.socket_path,
               what, (unsigned long long)(fp_cfg.retry_ns / 1000000ull));
    tk.failing = 1;
}

static int tk_send(const struct fp_msg *m) {
    ssize_t n = send(tk.fd, m, sizeof *m, MSG_NOSIGNAL | MSG_DONTWAIT);
    return n == (ssize_t)sizeof *m ? 0 : -1;
}

static void tk_connect(void) { /* caller holds tk.mu */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) { tk_fail("socket() failed"); return; }
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strcpy(addr.sun_path, fp_cfg.socket_path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        if (errno != EINPROGRESS && errno != EAGAIN) { close(fd); tk_fail(strerror(errno)); return; }
        struct pollfd p = {fd, POLLOUT, 0};
        int err = 0;
        socklen_t len = sizeof err;
        if (poll(&p, 1, (int)(fp_cfg.connect_timeout_ns / 1000000ull)) != 1 ||
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
            close(fd);
            tk_fail("connect timed out");
            return;
        }
    }
    tk.fd = fd;
    struct fp_msg hello;
    fp_msg_init(&hello, FP_MSG_HELLO);
    hello.mem_limit_bytes = fp_cfg.mem_limit;
    if (tk_send(&hello) != 0) { tk_fail("send failed"); return; }
    if (tk.failing) FP_LOG("token manager %s reachable again", fp_cfg.socket_path);
    tk.failing = 0;
}

/* Read one whole message before the deadline; -1 on timeout, EOF or error. */
static int tk_read(struct fp_msg *m, uint64_t deadline) {
    size_t got = 0;
    while (got < sizeof *m) {
        uint64_t now = fp_now_ns();
        if (now >= deadline) return -1;
        struct pollfd p = {tk.fd, POLLIN, 0};
        int ms = (int)((deadline - now + 999999ull) / 1000000ull);
        int r = poll(&p, 1, ms);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t n = recv(tk.fd, (char *)m + got, sizeof *m - got, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return (m->magic == FP_MAGIC && m->version == FP_PROTOCOL_VERSION) ? 0 : -1;
}

/* ---- memory caps and reports (protocol: MEM in both directions) ---- */
uint64_t fp_mem_cap(void) { return __atomic_load_n(&fp_cap, __ATOMIC_ACQUIRE); }
static void tk_on_msg(const struct fp_msg *m) {
    if (m->type == FP_MSG_MEM) __atomic_store_n(&fp_cap, m->mem_limit_bytes, __ATOMIC_RELEASE);
}
/* Apply what the manager sent while nobody was waiting (caps); bounded, never blocks long. */
static void tk_drain(void) { /* caller holds tk.mu */
    for (int i = 0; i < 64 && tk.fd >= 0; i++) {
        struct pollfd p = {tk.fd, POLLIN, 0};
        if (poll(&p, 1, 0) != 1) return;
        struct fp_msg m;
        if (tk_read(&m, fp_now_ns() + fp_cfg.connect_timeout_ns) != 0) {
            tk_fail("closed or bad message");
            return;
        }
        tk_on_msg(&m);
    }
}
void fp_mem_sync(void) {
    fp_config();
    if (!fp_cfg.socket_path[0]) return;
    pthread_mutex_lock(&tk.mu);
    if (tk.fd < 0 && fp_now_ns() >= tk.next_retry) {
        tk_connect();
        /* The manager answers HELLO with this process's cap; an older one does not (then
         * the wait costs one connect timeout, once). */
        struct fp_msg m;
        if (tk.fd >= 0 && tk_read(&m, fp_now_ns() + fp_cfg.connect_timeout_ns) == 0) tk_on_msg(&m);
    }
    tk_drain();
    pthread_mutex_unlock(&tk.mu);
}
void fp_mem_report(uint64_t used) {
    if (!fp_cfg.socket_path[0]) return;
    pthread_mutex_lock(&tk.mu);
    if (tk.fd >= 0) {
        struct fp_msg m;
        fp_msg_init(&m, FP_MSG_MEM);
        m.mem_used_bytes = used;
        m.mem_limit_bytes = fp_cfg.mem_limit;
        if (tk_send(&m) != 0) tk_fail("send failed");
    }
    pthread_mutex_unlock(&tk.mu);
}

static void tk_grant_local(uint64_t now) {
    tk.have_token = 1;
    tk.local = 1;
    tk.grant = now;
    tk.quota = fp_cfg.retry_ns; /* until the next reconnect attempt */
}

/* Get a token; always returns with one (from the manager, or locally on failure). */
static void tk_acquire(uint64_t used_ns) { /* caller holds tk.mu */
    uint64_t now = fp_now_ns();
    if (tk.fd < 0 && now >= tk.next_retry) tk_connect();
    if (tk.fd < 0) { tk_grant_local(now); return; }
    struct fp_msg req, rep;
    fp_msg_init(&req, FP_MSG_REQUEST);
    req.seq = ++tk.seq;
    req.used_ns = used_ns;
    if (tk_send(&req) != 0) { tk_fail("send failed"); tk_grant_local(fp_now_ns()); return; }
    uint64_t deadline = fp_now_ns() + fp_cfg.grant_timeout_ns;
    for (;;) {
        if (tk_read(&rep, deadline) != 0) {
            tk_fail("no grant (closed, timed out or bad message)");
            tk_grant_local(fp_now_ns());
            return;
        }
        if (rep.type == FP_MSG_GRANT && rep.seq == req.seq) break;
        tk_on_msg(&rep); /* a memory cap is applied; a stale GRANT of an older request skipped */
    }
    tk.have_token = 1;
    tk.local = 0;
    tk.grant = fp_now_ns();
    tk.quota = rep.quota_ns;
}

typedef CUresult (*ctx_sync_fn)(void);
typedef CUresult (*is_capturing_fn)(CUstream, int *);

/* Synchronizing while a stream is being captured into a CUDA graph would invalidate the
 * capture, so the expiry sync is skipped then (the charge is the wall time so far). */
static int fp_capturing(CUstream s) {
    static is_capturing_fn fn;
    if (!fn) {
        dlsym_fn real_dlsym = fp_dlsym_real();
        void *h = fp_lib_handle(0);
        if (real_dlsym && h) fn = (is_capturing_fn)real_dlsym(h, "cuStreamIsCapturing");
        if (!fn) return 1; /* cannot tell: do not risk it */
    }
    int status = 0;
    return fn(s, &status) != CUDA_SUCCESS || status != 0;
}

/* A cuCtxSynchronize that takes longer than this found kernels still queued. */
#define FP_QUEUED_WORK_NS 200000ull

/* Pre-hook of every launch: make sure we hold an unexpired token. */
static void fp_gate(CUstream stream) {
    fp_config();
    if (!fp_cfg.socket_path[0]) return; /* no manager configured: no time tokens */
    pthread_mutex_lock(&tk.mu);
    uint64_t now = fp_now_ns();
    if (!(tk.have_token && now < tk.grant + tk.quota)) {
        uint64_t used = 0;
        if (tk.have_token && !tk.local) {
            uint64_t end = tk.grant + tk.quota;
            if (now - end <= fp_cfg.idle_gap_ns) {
                /* Busy through expiry: wait for the queued kernels, so the charge is the
                 * whole wall time grant -> GPU done (FaST's overuse, charged back). */
                if (fp_cfg.sync_on_expiry && tk.launched && !fp_capturing(stream)) {
                    ctx_sync_fn sync = (ctx_sync_fn)fp_real(FP_cuCtxSynchronize);
                    if (sync) sync();
                    now = fp_now_ns();
                }
                used = now - tk.grant;
            } else {
                /* Idle after the token: charge up to the last launch, never the idle gap. */
                used = tk.last_launch - tk.grant > tk.quota ? tk.last_launch - tk.grant : tk.quota;
                /* ...unless the device was not idle: a launcher blocked on a full queue (or
                 * descheduled) comes back late although its kernels kept running.  A sync of
                 * an idle context returns in microseconds; one that waits found queued work,
                 * so the device was busy all along and the whole time is charged. */
                if (fp_cfg.sync_on_expiry && tk.launched && !fp_capturing(stream)) {
                    ctx_sync_fn sync = (ctx_sync_fn)fp_real(FP_cuCtxSynchronize);
                    if (sync) sync();
                    uint64_t after = fp_now_ns();
                    if (after - now > FP_QUEUED_WORK_NS) used = after - tk.grant;
                    now = after;
                }
            }
        }
        tk.have_token = 0;
        tk_acquire(used);
        tk.launched = 0;
        now = fp_now_ns();
    }
    tk.last_launch = now;
    tk.launched = 1;
    tk.synced_at = 0; /* busy again: no early return */
    pthread_mutex_unlock(&tk.mu);
}

/* Early return.  After a successful sync the queued work is done; if no launch follows
 * within FP_HOOK_IDLE_GAP_US the tenant is idle and the token goes back, charged up to the
 * sync.  Releasing on every sync instead would cost a manager round trip per batch and
 * hand the GPU away between back-to-back batches; the short grace period avoids both. */
static void tk_release_locked(uint64_t used) {
    struct fp_msg rel;
    fp_msg_init(&rel, FP_MSG_RELEASE);
    rel.seq = tk.seq;
    rel.used_ns = used;
    tk.have_token = 0;
    tk.synced_at = 0;
    if (tk_send(&rel) != 0) tk_fail("send failed");
}

static void *tk_releaser(void *arg) {
    (void)arg;
    pthread_mutex_lock(&tk.mu);
    for (;;) {
        if (!(tk.have_token && !tk.local && tk.fd >= 0 && tk.synced_at)) {
            pthread_cond_wait(&tk.cv, &tk.mu);
            continue;
        }
        uint64_t deadline = tk.synced_at + fp_cfg.idle_gap_ns, now = fp_now_ns();
        if (now >= deadline) {
            tk_release_locked(tk.synced_at - tk.grant);
            continue;
        }
        struct timespec ts = {(time_t)(deadline / 1000000000ull), (long)(deadline % 1000000000ull)};
        pthread_cond_timedwait(&tk.cv, &tk.mu, &ts);
    }
    return NULL;
}

/* At exit, a held token goes back with what it was used for (up to the last sync, else
 * now), so the manager charges the process's last work instead of guessing at expiry.
 * No driver call here: the driver may already be torn down.  trylock: a thread that died
 * holding the lock must not hang the exit. */
__attribute__((destructor)) static void tk_at_exit(void) {
    if (!fp_cfg.socket_path[0] || pthread_mutex_trylock(&tk.mu) != 0) return;
    if (tk.have_token && !tk.local && tk.fd >= 0)
        tk_release_locked((tk.synced_at ? tk.synced_at : fp_now_ns()) - tk.grant);
    pthread_mutex_unlock(&tk.mu);
}

static void tk_releaser_start(void) { /* caller holds tk.mu */
    tk_releaser_started = 1;
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC); /* deadlines are fp_now_ns() values */
    pthread_cond_init(&tk.cv, &a);
    pthread_condattr_destroy(&a);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, tk_releaser, NULL) != 0)
        FP_LOG("cannot start the token releaser thread; tokens return only at expiry");
    pthread_attr_destroy(&attr);
}

void fp_synced(void) {
    if (!fp_cfg.socket_path[0]) return;
    pthread_mutex_lock(&tk.mu);
    if (!tk_releaser_started) tk_releaser_start();
    if (tk.have_token && !tk.local && tk.fd >= 0) {
        tk.synced_at = fp_now_ns();
        pthread_cond_signal(&tk.cv);
    }
    pthread_mutex_unlock(&tk.mu);
}

/* ======================= the hooks ======================= */

/* --- launches --- */
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **);
static CUresult fp_launch(int i, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned shm, CUstream s, void **params, void **extra) {
    launch_fn fn = (launch_fn)fp_real(i);
    if (!fn) return MISSING;
    fp_gate(s);
    return fn(f, gx, gy, gz, bx, by, bz, shm, s, params, extra);
}
FP_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                  unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e) {
    return fp_launch(FP_cuLaunchKernel, f, gx, gy, gz, bx, by, bz, shm, s, p, e);
}
FP_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                       unsigned by, unsigned bz, unsigned shm, CUstream s, void **p,
                                       void **e) {
    return fp_launch(FP_cuLaunchKernel_ptsz, f, gx, gy, gz, bx, by, bz, shm, s, p, e);
}

typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
static CUresult fp_launch_ex(int i, const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
    launch_ex_fn fn = (launch_ex_fn)fp_real(i);
    if (!fn) return MISSING;
    fp_gate(c ? c->hStream : NULL);
    return fn(c, f, p, e);
}
FP_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
    return fp_launch_ex(FP_cuLaunchKernelEx, c, f, p, e);
}
FP_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **p, void **e) {
    return fp_launch_ex(FP_cuLaunchKernelEx_ptsz, c, f, p, e);
}

typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, CUstream, void **);
static CUresult fp_coop(int i, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shm, CUstream s, void **p) {
    coop_fn fn = (coop_fn)fp_real(i);
    if (!fn) return MISSING;
    fp_gate(s);
    return fn(f, gx, gy, gz, bx, by, bz, shm, s, p);
}
FP_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                             unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                             CUstream s, void **p) {
    return fp_coop(FP_cuLaunchCooperativeKernel, f, gx, gy, gz, bx, by, bz, shm, s, p);
}
FP_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                  unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                                  CUstream s, void **p) {
    return fp_coop(FP_cuLaunchCooperativeKernel_ptsz, f, gx, gy, gz, bx, by, bz, shm, s, p);
}

typedef CUresult (*graph_fn)(CUgraphExec, CUstream);
static CUresult fp_graph(int i, CUgraphExec g, CUstream s) {
    graph_fn fn = (graph_fn)fp_real(i);
    if (!fn) return MISSING;
    fp_gate(s);
    return fn(g, s);
}
FP_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { return fp_graph(FP_cuGraphLaunch, g, s); }
FP_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) {
    return fp_graph(FP_cuGraphLaunch_ptsz, g, s);
}

/* --- symbol resolution --- */
/* Swap the driver's pointer for our hook; remember the driver's as the real one. */
static void *fp_wrap_proc(const char *symbol, void *real, int cuda_version, cuuint64_t flags) {
    if (!real || !fp_maybe_ours(symbol)) return real;
    int i;
    if (strcmp(symbol, "cuGetProcAddress") == 0)
        /* the v1 signature has one argument fewer: pick by the version asked for */
        i = cuda_version >= 12000 ? FP_cuGetProcAddress_v2 : FP_cuGetProcAddress;
    else
        i = fp_find_proc(symbol, (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) ? 1 : 0);
    if (i < 0 || real == fp_hook_ptr(i)) return real;
    void *expected = NULL;
    __atomic_compare_exchange_n(&fp_real_ptr[i], &expected, real, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return fp_hook_ptr(i);
}
FP_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags) {
    __typeof__(&cuGetProcAddress) fn = REAL(cuGetProcAddress);
    if (!fn) return MISSING;
    CUresult r = fn(symbol, pfn, cuda_version, flags);
    if (r == CUDA_SUCCESS && pfn) *pfn = fp_wrap_proc(symbol, *pfn, cuda_version, flags);
    return r;
}
FP_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
                                       int *status) {
    __typeof__(&cuGetProcAddress_v2) fn = REAL(cuGetProcAddress_v2);
    if (!fn) return MISSING;
    CUresult r = fn(symbol, pfn, cuda_version, flags, status);
    if (r == CUDA_SUCCESS && pfn) *pfn = fp_wrap_proc(symbol, *pfn, cuda_version, flags);
    return r;
}

/* The dispatch table: hook i's address, generated from the same list. */
static void *fp_hook_ptr(int i) {
    static void *const table[FP_NSYMS] = {
#define FP_SYM(sym, proc, ptds) (void *)&sym,
#include "hooked_symbols.h"
#undef FP_SYM
    };
    return (i >= 0 && i < FP_NSYMS) ? table[i] : NULL;
}

FP_EXPORT void *dlsym(void *handle, const char *name) {
    dlsym_fn real_dlsym = fp_dlsym_real();
    if (!real_dlsym) return NULL; /* cannot happen on glibc; nothing sane to return */
    if (fp_maybe_ours(name)) {
        int i = fp_find_sym(name);
        if (i >= 0) {
            /* Only hand out the hook where the caller's handle really has the symbol. */
            void *p = real_dlsym(handle, name);
            if (!p) return NULL;
            /* The real function is always resolved in the explicit libcuda handle
             * (fp_real), never in the caller's handle, which may well be ourselves. */
            return fp_hook_ptr(i);
        }
    }
    return real_dlsym(handle, name);
}
