/* A fake libcuda.so.1 for hook tests on machines without a GPU.
 * Kernels busy-wait: the duration in ns is *(uint64_t *)kernelParams[0], else
 * FAKE_KERNEL_NS.  Memory calls track a fake device of FAKE_DEVICE_BYTES (default 1 GiB).
 * At exit it writes {"busy_ns","launches","launches_ptsz","syncs","copies","max_queued"} to
 * FAKE_CUDA_STATS.
 *
 * FAKE_CUDA_ASYNC=1 makes it behave like a GPU: a launch queues the kernel and returns at
 * once; one device thread runs queued kernels in order; cuCtxSynchronize,
 * cuStreamSynchronize, cuEventSynchronize and the synchronous cuMemcpy* wait until the
 * queue is empty.  The queue holds FAKE_QUEUE_DEPTH kernels (default 64); a launch into a
 * full queue blocks until one finishes, as a full push buffer does.  Without it, kernels
 * run inside the launch call and syncs return at once.
 * Linked with -Bsymbolic so the pointers cuGetProcAddress hands out are its own
 * functions, as the real driver's are, never the preloaded hook's. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;

static uint64_t busy_ns, launches, launches_ptsz, syncs, copies, max_queued;
static uint64_t dev_total = 1ull << 30, dev_used, next_addr = 0x10000000ull;
#define MAXA 65536
static struct { uint64_t addr, size; } allocs[MAXA];

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}
/* ---- the asynchronous device: a FIFO of kernel durations and one thread running them ---- */
#define QMAX 4096
static int async_mode;
static unsigned qdepth = 64;
static uint64_t q[QMAX];
static unsigned qhead, qlen, running; /* running: the device thread is inside a kernel */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER, cv_done = PTHREAD_COND_INITIALIZER;

static void busy_wait(uint64_t ns) { /* caller does not hold mu */
    uint64_t t0 = now_ns();
    while (now_ns() - t0 < ns) {}
    uint64_t spent = now_ns() - t0;
    pthread_mutex_lock(&mu);
    busy_ns += spent;
    launches++;
    pthread_mutex_unlock(&mu);
}
static void *device_thread(void *arg) {
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!qlen) pthread_cond_wait(&cv_work, &mu);
        uint64_t ns = q[qhead];
        running = 1;
        pthread_mutex_unlock(&mu);
        busy_wait(ns);
        pthread_mutex_lock(&mu);
        qhead = (qhead + 1) % QMAX;
        qlen--;
        running = 0;
        pthread_cond_broadcast(&cv_done);
    }
    return NULL;
}
/* Wait for every queued kernel (a no-op in synchronous mode). */
static void drain(void) {
    if (!async_mode) return;
    pthread_mutex_lock(&mu);
    while (qlen || running) pthread_cond_wait(&cv_done, &mu);
    pthread_mutex_unlock(&mu);
}
__attribute__((constructor)) static void init(void) {
    const char *t = getenv("FAKE_DEVICE_BYTES");
    if (t) dev_total = strtoull(t, NULL, 10);
    const char *a = getenv("FAKE_CUDA_ASYNC");
    const char *d = getenv("FAKE_QUEUE_DEPTH");
    if (d && atoi(d) > 0) qdepth = (unsigned)atoi(d) < QMAX ? (unsigned)atoi(d) : QMAX;
    if (a && strcmp(a, "1") == 0) {
        pthread_t th;
        async_mode = pthread_create(&th, NULL, device_thread, NULL) == 0;
        if (async_mode) pthread_detach(th);
    }
}
__attribute__((destructor)) static void fini(void) {
    drain(); /* the process's work finishes before it is counted, as on a GPU at exit */
    const char *p = getenv("FAKE_CUDA_STATS");
    if (!p) return;
    FILE *f = fopen(p, "w");
    if (!f) return;
    fprintf(f, "{\"busy_ns\": %llu, \"launches\": %llu, \"launches_ptsz\": %llu, \"syncs\": %llu, "
            "\"copies\": %llu, \"max_queued\": %llu}\n",
            (unsigned long long)busy_ns, (unsigned long long)launches,
            (unsigned long long)launches_ptsz, (unsigned long long)syncs,
            (unsigned long long)copies, (unsigned long long)max_queued);
    fclose(f);
}
static void spin(void **params) {
    uint64_t ns = params && params[0] ? *(uint64_t *)params[0] : 0;
    if (!ns && getenv("FAKE_KERNEL_NS")) ns = strtoull(getenv("FAKE_KERNEL_NS"), NULL, 10);
    if (!async_mode) { busy_wait(ns); return; }
    pthread_mutex_lock(&mu);
    while (qlen >= qdepth) pthread_cond_wait(&cv_done, &mu);
    q[(qhead + qlen) % QMAX] = ns;
    qlen++;
    if (qlen > max_queued) max_queued = qlen;
    pthread_cond_signal(&cv_work);
    pthread_mutex_unlock(&mu);
}
static CUresult synced(void) {
    drain();
    pthread_mutex_lock(&mu);
    syncs++;
    pthread_mutex_unlock(&mu);
    return 0;
}
static CUresult copied(void) {
    drain();
    pthread_mutex_lock(&mu);
    copies++;
    pthread_mutex_unlock(&mu);
    return 0;
}
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
                        unsigned shm, void *s, void **p, void **x) {
    (void)f; (void)a; (void)b; (void)c; (void)d; (void)e; (void)g; (void)shm; (void)s; (void)x;
    spin(p);
    return 0;
}
CUresult cuLaunchKernel_ptsz(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e,
                             unsigned g, unsigned shm, void *s, void **p, void **x) {
    launches_ptsz++;
    return cuLaunchKernel(f, a, b, c, d, e, g, shm, s, p, x);
}
CUresult cuLaunchKernelEx(const void *cfg, void *f, void **p, void **x) { (void)cfg; (void)f; (void)x; spin(p); return 0; }
CUresult cuLaunchKernelEx_ptsz(const void *cfg, void *f, void **p, void **x) {
    launches_ptsz++;
    return cuLaunchKernelEx(cfg, f, p, x);
}
CUresult cuLaunchCooperativeKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e,
                                   unsigned g, unsigned shm, void *s, void **p) {
    return cuLaunchKernel(f, a, b, c, d, e, g, shm, s, p, NULL);
}
CUresult cuLaunchCooperativeKernel_ptsz(void *f, unsigned a, unsigned b, unsigned c, unsigned d,
                                        unsigned e, unsigned g, unsigned shm, void *s, void **p) {
    launches_ptsz++;
    return cuLaunchKernel(f, a, b, c, d, e, g, shm, s, p, NULL);
}
CUresult cuGraphLaunch(void *g, void *s) { (void)g; (void)s; spin(NULL); return 0; }
CUresult cuGraphLaunch_ptsz(void *g, void *s) { launches_ptsz++; return cuGraphLaunch(g, s); }
CUresult cuCtxSynchronize(void) { return synced(); }
CUresult cuStreamIsCapturing(void *s, int *status) { (void)s; *status = 0; return 0; }
CUresult cuStreamSynchronize(void *s) { (void)s; return synced(); }
CUresult cuStreamSynchronize_ptsz(void *s) { (void)s; return synced(); }
CUresult cuEventSynchronize(void *e) { (void)e; return synced(); }
/* synchronous copies: wait for the queue, move no bytes (the fake device has none) */
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { (void)d; (void)s; (void)n; return copied(); }
CUresult cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { return cuMemcpy(d, s, n); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return cuMemcpy(d, s, n); }
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { return cuMemcpy(d, s, n); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { (void)d; (void)s; (void)n; return copied(); }
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n) { return cuMemcpyHtoD_v2(d, s, n); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { (void)d; (void)s; (void)n; return copied(); }
CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n) { return cuMemcpyDtoH_v2(d, s, n); }

CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t n) {
    if (dev_used + n > dev_total) return 2;
    for (int i = 0; i < MAXA; i++) {
        if (!allocs[i].addr) {
            allocs[i].addr = next_addr; allocs[i].size = n;
            *d = next_addr; next_addr += (n + 255) & ~255ull; next_addr += 256; dev_used += n;
            return 0;
        }
    }
    return 2;
}
CUresult cuMemFree_v2(CUdeviceptr d) {
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].addr == d) { dev_used -= allocs[i].size; allocs[i].addr = 0; return 0; }
    return 1; /* CUDA_ERROR_INVALID_VALUE */
}
CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, void *s) { (void)s; return cuMemAlloc_v2(d, n); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, void *s) { return cuMemAllocAsync(d, n, s); }
CUresult cuMemFreeAsync(CUdeviceptr d, void *s) { (void)s; return cuMemFree_v2(d); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr d, void *s) { return cuMemFreeAsync(d, s); }
CUresult cuMemAllocManaged(CUdeviceptr *d, size_t n, unsigned f) { (void)f; return cuMemAlloc_v2(d, n); }
/* pitch: rows padded to 512 bytes, as a GPU's texture alignment would */
CUresult cuMemAllocPitch_v2(CUdeviceptr *d, size_t *pitch, size_t w, size_t h, unsigned e) {
    (void)e;
    *pitch = (w + 511) & ~(size_t)511;
    return cuMemAlloc_v2(d, *pitch * h);
}
/* VMM: a generic handle is the fake address of its backing allocation */
CUresult cuMemCreate(unsigned long long *handle, size_t n, const void *prop, unsigned long long flags) {
    (void)prop; (void)flags;
    CUdeviceptr d = 0;
    CUresult r = cuMemAlloc_v2(&d, n);
    if (r == 0) *handle = d;
    return r;
}
CUresult cuMemRelease(unsigned long long handle) { return cuMemFree_v2(handle); }
CUresult cuMemGetInfo_v2(size_t *fr, size_t *t) { *fr = dev_total - dev_used; *t = dev_total; return 0; }
CUresult cuDeviceTotalMem_v2(size_t *b, int dev) { (void)dev; *b = dev_total; return 0; }

struct entry { const char *name; void *fn; void *ptds; };
static const struct entry table[] = {
    {"cuInit", (void *)cuInit, NULL},
    {"cuLaunchKernel", (void *)cuLaunchKernel, (void *)cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", (void *)cuLaunchKernelEx, (void *)cuLaunchKernelEx_ptsz},
    {"cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel, (void *)cuLaunchCooperativeKernel_ptsz},
    {"cuGraphLaunch", (void *)cuGraphLaunch, (void *)cuGraphLaunch_ptsz},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize, NULL},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize, (void *)cuStreamSynchronize_ptsz},
    {"cuEventSynchronize", (void *)cuEventSynchronize, NULL},
    {"cuMemcpy", (void *)cuMemcpy, (void *)cuMemcpy_ptds},
    {"cuMemcpyHtoD", (void *)cuMemcpyHtoD_v2, (void *)cuMemcpyHtoD_v2_ptds},
    {"cuMemcpyDtoH", (void *)cuMemcpyDtoH_v2, (void *)cuMemcpyDtoH_v2_ptds},
    {"cuMemcpyDtoD", (void *)cuMemcpyDtoD_v2, (void *)cuMemcpyDtoD_v2_ptds},
    {"cuMemAlloc", (void *)cuMemAlloc_v2, NULL},
    {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2, NULL},
    {"cuMemCreate", (void *)cuMemCreate, NULL},
    {"cuMemRelease", (void *)cuMemRelease, NULL},
    {"cuMemFree", (void *)cuMemFree_v2, NULL},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync, (void *)cuMemFreeAsync_ptsz},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged, NULL},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2, NULL},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2, NULL},
};
static CUresult lookup(const char *sym, void **pfn, cuuint64_t flags) {
    for (size_t i = 0; i < sizeof table / sizeof *table; i++) {
        if (strcmp(table[i].name, sym) == 0) {
            *pfn = (flags & 2) && table[i].ptds ? table[i].ptds : table[i].fn;
            return 0;
        }
    }
    *pfn = NULL;
    return 500;
}
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *st) {
    (void)ver;
    CUresult r = lookup(sym, pfn, flags);
    if (st) *st = r == 0 ? 0 : 1;
    return r;
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags) {
    (void)ver;
    return lookup(sym, pfn, flags);
}
/* a cuBLAS-like name the hook must pass through untouched */
int cublasFakeCreate(void) { return 42; }
