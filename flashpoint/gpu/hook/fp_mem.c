/* fp_mem.c - device-memory accounting and limits for the hook (see fp_hook.c's header).
 *
 * Each allocation reserves its bytes under the limit BEFORE the real call (so two threads
 * cannot both pass the check), the real call runs, and only on success the pointer or
 * handle is recorded with its size; a failed call gives the reservation back.  Frees are
 * forgotten only after the real free succeeded.  cuMemGetInfo, cuDeviceTotalMem and
 * nvmlDeviceGetMemoryInfo report min(real, limit) so every API tells the same story.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "fp_hook_internal.h"

/* ======================= memory accounting ======================= */
#define FP_BUCKETS 4096
struct fp_alloc { uint64_t key; uint64_t size; int kind; struct fp_alloc *next; };
static struct fp_alloc *fp_allocs[FP_BUCKETS];
static pthread_mutex_t fp_mem_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t fp_mem_used;
enum { FP_KIND_PTR = 1, FP_KIND_HANDLE = 2 };

static size_t fp_bucket(uint64_t key) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 52) % FP_BUCKETS; }

/* The limit in force: FP_HOOK_MEM_LIMIT_BYTES (this process, always enforced, also when the
 * manager is away) and the manager's cap (the tenant's limit minus what its other processes
 * hold), whichever is smaller; 0 = none.  The cap is as fresh as the last report the
 * manager saw, so two processes of one tenant allocating at the same instant may overshoot
 * the tenant's limit briefly; the per-process limit is never exceeded. */
static uint64_t fp_mem_limit(void) {
    uint64_t a = fp_cfg.mem_limit, b = fp_mem_cap();
    return !a ? b : !b ? a : (a < b ? a : b);
}
static void fp_mem_changed(void) {
    pthread_mutex_lock(&fp_mem_mu);
    uint64_t used = fp_mem_used;
    pthread_mutex_unlock(&fp_mem_mu);
    fp_mem_report(used);
}

/* Reserve bytes before the real call (so two threads cannot both pass the check). */
static int fp_mem_reserve(uint64_t size) {
    fp_config();
    fp_mem_sync(); /* the manager's latest cap, outside fp_mem_mu */
    uint64_t limit = fp_mem_limit();
    int ok = 1;
    pthread_mutex_lock(&fp_mem_mu);
    if (limit && (size > limit || fp_mem_used > limit - size)) ok = 0;
    else fp_mem_used += size;
    pthread_mutex_unlock(&fp_mem_mu);
    return ok;
}
static void fp_mem_unreserve(uint64_t size) {
    pthread_mutex_lock(&fp_mem_mu);
    fp_mem_used -= size;
    pthread_mutex_unlock(&fp_mem_mu);
}
/* After success: remember key -> size (the reservation becomes the allocation). */
static void fp_mem_record(uint64_t key, int kind, uint64_t size) {
    struct fp_alloc *a = malloc(sizeof *a);
    pthread_mutex_lock(&fp_mem_mu);
    if (a) {
        a->key = key; a->size = size; a->kind = kind;
        size_t b = fp_bucket(key);
        a->next = fp_allocs[b];
        fp_allocs[b] = a;
    } else {
        fp_mem_used -= size; /* cannot track it; do not leak it into the used count */
    }
    pthread_mutex_unlock(&fp_mem_mu);
    fp_mem_changed();
}
static void fp_mem_forget(uint64_t key, int kind) {
    pthread_mutex_lock(&fp_mem_mu);
    struct fp_alloc **pp = &fp_allocs[fp_bucket(key)];
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->key == key && (*pp)->kind == kind) {
            struct fp_alloc *a = *pp;
            *pp = a->next;
            fp_mem_used -= a->size;
            free(a);
            break;
        }
    }
    pthread_mutex_unlock(&fp_mem_mu);
    fp_mem_changed();
}
/* (total, free) as this process should see them: the limit caps both. */
static void fp_mem_view(uint64_t *total, uint64_t *free_) {
    fp_config();
    uint64_t limit = fp_mem_limit();
    if (!limit) return;
    pthread_mutex_lock(&fp_mem_mu);
    uint64_t left = fp_mem_used < limit ? limit - fp_mem_used : 0;
    pthread_mutex_unlock(&fp_mem_mu);
    if (total && *total > limit) *total = limit;
    if (free_ && *free_ > left) *free_ = left;
}

/* --- allocations: reserve (pre), real call, record (post, success only) --- */
FP_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    __typeof__(&cuMemAlloc_v2) fn = REAL(cuMemAlloc_v2);
    if (!fn) return MISSING;
    if (!fp_mem_reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, size);
    if (r == CUDA_SUCCESS) fp_mem_record(*dptr, FP_KIND_PTR, size);
    else fp_mem_unreserve(size);
    return r;
}
FP_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int size) { /* legacy 32-bit ABI */
    __typeof__(&cuMemAlloc) fn = REAL(cuMemAlloc);
    if (!fn) return MISSING;
    if (!fp_mem_reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, size);
    if (r == CUDA_SUCCESS) fp_mem_record(*dptr, FP_KIND_PTR, size);
    else fp_mem_unreserve(size);
    return r;
}
FP_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    __typeof__(&cuMemAllocManaged) fn = REAL(cuMemAllocManaged);
    if (!fn) return MISSING;
    if (!fp_mem_reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, size, flags);
    if (r == CUDA_SUCCESS) fp_mem_record(*dptr, FP_KIND_PTR, size);
    else fp_mem_unreserve(size);
    return r;
}
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
static CUresult fp_alloc_async(int i, CUdeviceptr *dptr, size_t size, CUstream s) {
    alloc_async_fn fn = (alloc_async_fn)fp_real(i);
    if (!fn) return MISSING;
    if (!fp_mem_reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, size, s);
    if (r == CUDA_SUCCESS) fp_mem_record(*dptr, FP_KIND_PTR, size);
    else fp_mem_unreserve(size);
    return r;
}
FP_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, CUstream s) {
    return fp_alloc_async(FP_cuMemAllocAsync, d, n, s);
}
FP_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, CUstream s) {
    return fp_alloc_async(FP_cuMemAllocAsync_ptsz, d, n, s);
}
/* Pitch: the real size (pitch*height) is known only after the call; pre-check the lower
 * bound width*height, then top the reservation up and undo the allocation if it no
 * longer fits. */
static CUresult fp_pitch_post(CUresult r, uint64_t key, uint64_t pitch, uint64_t h, uint64_t reserved,
                              CUresult (*free_fn)(uint64_t)) {
    if (r != CUDA_SUCCESS) { fp_mem_unreserve(reserved); return r; }
    uint64_t size = pitch * h;
    if (size > reserved && !fp_mem_reserve(size - reserved)) {
        fp_mem_unreserve(reserved);
        if (free_fn) free_fn(key);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (size < reserved) fp_mem_unreserve(reserved - size);
    fp_mem_record(key, FP_KIND_PTR, size);
    return r;
}
static CUresult fp_free_v2_real(uint64_t p) {
    CUresult (*fn)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))fp_real(FP_cuMemFree_v2);
    return fn ? fn((CUdeviceptr)p) : MISSING;
}
static CUresult fp_free_v1_real(uint64_t p) {
    CUresult (*fn)(CUdeviceptr_v1) = (CUresult(*)(CUdeviceptr_v1))fp_real(FP_cuMemFree);
    return fn ? fn((CUdeviceptr_v1)p) : MISSING;
}
FP_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned int e) {
    __typeof__(&cuMemAllocPitch_v2) fn = REAL(cuMemAllocPitch_v2);
    if (!fn) return MISSING;
    uint64_t lower = (uint64_t)w * h;
    if (!fp_mem_reserve(lower)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, pitch, w, h, e);
    return fp_pitch_post(r, r == CUDA_SUCCESS ? *dptr : 0, r == CUDA_SUCCESS ? *pitch : 0, h, lower,
                         fp_free_v2_real);
}
FP_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int w, unsigned int h,
                                   unsigned int e) {
    __typeof__(&cuMemAllocPitch) fn = REAL(cuMemAllocPitch);
    if (!fn) return MISSING;
    uint64_t lower = (uint64_t)w * h;
    if (!fp_mem_reserve(lower)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, pitch, w, h, e);
    return fp_pitch_post(r, r == CUDA_SUCCESS ? *dptr : 0, r == CUDA_SUCCESS ? *pitch : 0, h, lower,
                         fp_free_v1_real);
}
FP_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags) {
    __typeof__(&cuMemCreate) fn = REAL(cuMemCreate);
    if (!fn) return MISSING;
    if (!fp_mem_reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(handle, size, prop, flags);
    if (r == CUDA_SUCCESS) fp_mem_record(*handle, FP_KIND_HANDLE, size);
    else fp_mem_unreserve(size);
    return r;
}

/* --- frees: forget only after the real free succeeded --- */
FP_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    __typeof__(&cuMemFree_v2) fn = REAL(cuMemFree_v2);
    if (!fn) return MISSING;
    CUresult r = fn(p);
    if (r == CUDA_SUCCESS) fp_mem_forget(p, FP_KIND_PTR);
    return r;
}
FP_EXPORT CUresult cuMemFree(CUdeviceptr_v1 p) {
    __typeof__(&cuMemFree) fn = REAL(cuMemFree);
    if (!fn) return MISSING;
    CUresult r = fn(p);
    if (r == CUDA_SUCCESS) fp_mem_forget(p, FP_KIND_PTR);
    return r;
}
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
static CUresult fp_free_async(int i, CUdeviceptr p, CUstream s) {
    free_async_fn fn = (free_async_fn)fp_real(i);
    if (!fn) return MISSING;
    CUresult r = fn(p, s);
    if (r == CUDA_SUCCESS) fp_mem_forget(p, FP_KIND_PTR);
    return r;
}
FP_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { return fp_free_async(FP_cuMemFreeAsync, p, s); }
FP_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    return fp_free_async(FP_cuMemFreeAsync_ptsz, p, s);
}
FP_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    __typeof__(&cuMemRelease) fn = REAL(cuMemRelease);
    if (!fn) return MISSING;
    CUresult r = fn(h);
    if (r == CUDA_SUCCESS) fp_mem_forget(h, FP_KIND_HANDLE);
    return r;
}

/* --- reporting the limit --- */
FP_EXPORT CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
    __typeof__(&cuMemGetInfo_v2) fn = REAL(cuMemGetInfo_v2);
    if (!fn) return MISSING;
    CUresult r = fn(free_, total);
    if (r == CUDA_SUCCESS && free_ && total) {
        uint64_t t = *total, f = *free_;
        fp_mem_view(&t, &f);
        *total = (size_t)t;
        *free_ = (size_t)f;
    }
    return r;
}
FP_EXPORT CUresult cuMemGetInfo(unsigned int *free_, unsigned int *total) {
    __typeof__(&cuMemGetInfo) fn = REAL(cuMemGetInfo);
    if (!fn) return MISSING;
    CUresult r = fn(free_, total);
    if (r == CUDA_SUCCESS && free_ && total) {
        uint64_t t = *total, f = *free_;
        fp_mem_view(&t, &f);
        *total = (unsigned int)t;
        *free_ = (unsigned int)f;
    }
    return r;
}
FP_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    __typeof__(&cuDeviceTotalMem_v2) fn = REAL(cuDeviceTotalMem_v2);
    if (!fn) return MISSING;
    CUresult r = fn(bytes, dev);
    if (r == CUDA_SUCCESS && bytes) {
        uint64_t t = *bytes;
        fp_mem_view(&t, NULL);
        *bytes = (size_t)t;
    }
    return r;
}
FP_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    __typeof__(&cuDeviceTotalMem) fn = REAL(cuDeviceTotalMem);
    if (!fn) return MISSING;
    CUresult r = fn(bytes, dev);
    if (r == CUDA_SUCCESS && bytes) {
        uint64_t t = *bytes;
        fp_mem_view(&t, NULL);
        *bytes = (unsigned int)t;
    }
    return r;
}
FP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m) {
    __typeof__(&nvmlDeviceGetMemoryInfo) fn = REAL(nvmlDeviceGetMemoryInfo);
    if (!fn) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = fn(dev, m);
    if (r == NVML_SUCCESS && m) {
        uint64_t t = m->total, f = m->free;
        fp_mem_view(&t, &f);
        m->total = t;
        m->free = f;
        m->used = t - f;
    }
    return r;
}
FP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m) {
    __typeof__(&nvmlDeviceGetMemoryInfo_v2) fn = REAL(nvmlDeviceGetMemoryInfo_v2);
    if (!fn) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = fn(dev, m);
    if (r == NVML_SUCCESS && m) {
        uint64_t t = m->total, f = m->free;
        fp_mem_view(&t, &f);
        m->total = t;
        m->free = f;
        m->used = t - f > m->reserved ? t - f - m->reserved : 0;
    }
    return r;
}

