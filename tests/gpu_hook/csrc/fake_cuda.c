/* A fake libcuda.so.1 for hook tests on machines without a GPU.
 * Kernels busy-wait: the duration in ns is *(uint64_t *)kernelParams[0], else
 * FAKE_KERNEL_NS.  Memory calls track a fake device of FAKE_DEVICE_BYTES (default 1 GiB).
 * At exit it writes {"busy_ns","launches","launches_ptsz","syncs"} to FAKE_CUDA_STATS.
 * Linked with -Bsymbolic so the pointers cuGetProcAddress hands out are its own
 * functions, as the real driver's are, never the preloaded hook's. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;

static uint64_t busy_ns, launches, launches_ptsz, syncs;
static uint64_t dev_total = 1ull << 30, dev_used, next_addr = 0x10000000ull;
#define MAXA 65536
static struct { uint64_t addr, size; } allocs[MAXA];

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}
__attribute__((constructor)) static void init(void) {
    const char *t = getenv("FAKE_DEVICE_BYTES");
    if (t) dev_total = strtoull(t, NULL, 10);
}
__attribute__((destructor)) static void fini(void) {
    const char *p = getenv("FAKE_CUDA_STATS");
    if (!p) return;
    FILE *f = fopen(p, "w");
    if (!f) return;
    fprintf(f, "{\"busy_ns\": %llu, \"launches\": %llu, \"launches_ptsz\": %llu, \"syncs\": %llu}\n",
            (unsigned long long)busy_ns, (unsigned long long)launches,
            (unsigned long long)launches_ptsz, (unsigned long long)syncs);
    fclose(f);
}
static void spin(void **params) {
    uint64_t ns = params && params[0] ? *(uint64_t *)params[0] : 0;
    if (!ns && getenv("FAKE_KERNEL_NS")) ns = strtoull(getenv("FAKE_KERNEL_NS"), NULL, 10);
    uint64_t t0 = now_ns();
    while (now_ns() - t0 < ns) {}
    busy_ns += now_ns() - t0;
    launches++;
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
CUresult cuLaunchCooperativeKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e,
                                   unsigned g, unsigned shm, void *s, void **p) {
    return cuLaunchKernel(f, a, b, c, d, e, g, shm, s, p, NULL);
}
CUresult cuGraphLaunch(void *g, void *s) { (void)g; (void)s; spin(NULL); return 0; }
CUresult cuCtxSynchronize(void) { syncs++; return 0; }
CUresult cuStreamIsCapturing(void *s, int *status) { (void)s; *status = 0; return 0; }
CUresult cuStreamSynchronize(void *s) { (void)s; syncs++; return 0; }
CUresult cuEventSynchronize(void *e) { (void)e; syncs++; return 0; }

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
CUresult cuMemFreeAsync(CUdeviceptr d, void *s) { (void)s; return cuMemFree_v2(d); }
CUresult cuMemAllocManaged(CUdeviceptr *d, size_t n, unsigned f) { (void)f; return cuMemAlloc_v2(d, n); }
CUresult cuMemGetInfo_v2(size_t *fr, size_t *t) { *fr = dev_total - dev_used; *t = dev_total; return 0; }
CUresult cuDeviceTotalMem_v2(size_t *b, int dev) { (void)dev; *b = dev_total; return 0; }

struct entry { const char *name; void *fn; void *ptds; };
static const struct entry table[] = {
    {"cuInit", (void *)cuInit, NULL},
    {"cuLaunchKernel", (void *)cuLaunchKernel, (void *)cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", (void *)cuLaunchKernelEx, NULL},
    {"cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel, NULL},
    {"cuGraphLaunch", (void *)cuGraphLaunch, NULL},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize, NULL},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize, NULL},
    {"cuEventSynchronize", (void *)cuEventSynchronize, NULL},
    {"cuMemAlloc", (void *)cuMemAlloc_v2, NULL},
    {"cuMemFree", (void *)cuMemFree_v2, NULL},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync, NULL},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync, NULL},
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
