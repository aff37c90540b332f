/* fp_hook_internal.h - what fp_hook.c (tokens, symbol resolution), fp_sync.c (sync
 * points) and fp_mem.c (memory accounting) share: the CUDA/NVML types we declare ourselves, the symbol enum generated
 * from hooked_symbols.h, configuration, logging and real-symbol resolution.  Not part of
 * any interface: everything here has hidden visibility in the built library. */
#ifndef FP_HOOK_INTERNAL_H
#define FP_HOOK_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

/* ---- the few CUDA / NVML types we need (no CUDA headers on build hosts) ---- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef void *CUfunction, *CUstream, *CUevent, *CUgraphExec;
typedef struct CUlaunchConfig_st { /* layout fixed since CUDA 11.8 */
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
typedef struct CUmemAllocationProp_st CUmemAllocationProp;
typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
#define NVML_SUCCESS 0
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2ULL

#define FP_EXPORT __attribute__((visibility("default")))

/* ---- the symbol enum, from the one X-macro list ---- */
enum fp_sym {
#define FP_SYM(sym, proc, ptds) FP_##sym,
#include "hooked_symbols.h"
#undef FP_SYM
    FP_NSYMS
};

/* ---- logging and time ---- */
extern int fp_quiet;
#define FP_LOG(...)                                                             \
    do {                                                                        \
        if (!fp_quiet) {                                                        \
            fprintf(stderr, "[fp_hook %d] ", (int)getpid());                   \
            fprintf(stderr, __VA_ARGS__);                                       \
            fputc('\n', stderr);                                                \
        }                                                                       \
    } while (0)

static inline uint64_t fp_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- configuration (read once from the environment; see fp_hook.c's header) ---- */
struct fp_config {
    char socket_path[108];
    uint32_t tenant;
    uint64_t mem_limit;
    uint64_t connect_timeout_ns, grant_timeout_ns, retry_ns, idle_gap_ns;
    int sync_on_expiry;
    const char *libcuda, *libnvml;
};

extern struct fp_config fp_cfg;
void fp_config(void);

/* The real function of hooked symbol i, resolved in the explicit libcuda/libnvidia-ml handle. */
void *fp_real(int i);
#define REAL(sym) ((__typeof__(&sym))fp_real(FP_##sym))
#define MISSING CUDA_ERROR_NOT_FOUND

/* ---- memory reports to the token manager (fp_hook.c, called by fp_mem.c) ----
 * fp_mem_sync: before an allocation, connect if needed and apply the per-process cap the
 * manager last sent (its tenant's limit minus what the tenant's other processes hold);
 * fp_mem_cap: that cap (0 = none); fp_mem_report: after an allocation or free succeeded,
 * send this process's device bytes in use.  None of them is called with fp_mem_mu held. */
void fp_mem_sync(void);
uint64_t fp_mem_cap(void);
void fp_mem_report(uint64_t used);

/* ---- sync points: fp_synced (fp_hook.c) is called by the hooks of fp_sync.c after a
 * successful sync; it starts the early-return grace period of a held token. ---- */
void fp_synced(void);
FP_EXPORT CUresult cuCtxSynchronize(void);
FP_EXPORT CUresult cuStreamSynchronize(CUstream s);
FP_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s);
FP_EXPORT CUresult cuEventSynchronize(CUevent e);
FP_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n);
FP_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
FP_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n);
FP_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
FP_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n);
FP_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n);
FP_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n);
FP_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n);

/* ---- the memory hooks (fp_mem.c), declared for the dispatch table in fp_hook.c ---- */
FP_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size);
FP_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int size);
FP_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags);
FP_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, CUstream s);
FP_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, CUstream s);
FP_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned int e);
FP_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int w, unsigned int h,
                                   unsigned int e);
FP_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags);
FP_EXPORT CUresult cuMemFree_v2(CUdeviceptr p);
FP_EXPORT CUresult cuMemFree(CUdeviceptr_v1 p);
FP_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
FP_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s);
FP_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h);
FP_EXPORT CUresult cuMemGetInfo_v2(size_t *free_, size_t *total);
FP_EXPORT CUresult cuMemGetInfo(unsigned int *free_, unsigned int *total);
FP_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
FP_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
FP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m);
FP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m);

#endif
