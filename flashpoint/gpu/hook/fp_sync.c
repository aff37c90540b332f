/* fp_sync.c - the sync-point hooks: after a successful synchronize (context, stream,
 * event) or a synchronous copy the queued work is done, so the token client (fp_hook.c)
 * measures the holder's time to here and may return the token early (fp_synced).
 * Synchronous cuMemcpy* count because the driver returns from them only after the work
 * queued before them (legacy default stream, or the thread's for _ptds), as FaST-GShare
 * treats them.  Each hook: real call, then the post-hook only on success. */
#define _GNU_SOURCE
#include "fp_hook_internal.h"

FP_EXPORT CUresult cuCtxSynchronize(void) {
    __typeof__(&cuCtxSynchronize) fn = REAL(cuCtxSynchronize);
    if (!fn) return MISSING;
    CUresult r = fn();
    if (r == CUDA_SUCCESS) fp_synced();
    return r;
}
typedef CUresult (*stream_sync_fn)(CUstream);
static CUresult fp_stream_sync(int i, CUstream s) {
    stream_sync_fn fn = (stream_sync_fn)fp_real(i);
    if (!fn) return MISSING;
    CUresult r = fn(s);
    if (r == CUDA_SUCCESS) fp_synced();
    return r;
}
FP_EXPORT CUresult cuStreamSynchronize(CUstream s) { return fp_stream_sync(FP_cuStreamSynchronize, s); }
FP_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) {
    return fp_stream_sync(FP_cuStreamSynchronize_ptsz, s);
}
FP_EXPORT CUresult cuEventSynchronize(CUevent e) {
    __typeof__(&cuEventSynchronize) fn = REAL(cuEventSynchronize);
    if (!fn) return MISSING;
    CUresult r = fn(e);
    if (r == CUDA_SUCCESS) fp_synced();
    return r;
}

/* Synchronous copies: the driver returns only after the work queued before them (legacy
 * default stream or, for _ptds, the thread's), so a successful one is a sync point. */
typedef CUresult (*copy_fn)(CUdeviceptr, CUdeviceptr, size_t);
static CUresult fp_copy(int i, CUdeviceptr dst, CUdeviceptr src, size_t n) {
    copy_fn fn = (copy_fn)fp_real(i);
    if (!fn) return MISSING;
    CUresult r = fn(dst, src, n);
    if (r == CUDA_SUCCESS) fp_synced();
    return r;
}
FP_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return fp_copy(FP_cuMemcpy, dst, src, n); }
FP_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return fp_copy(FP_cuMemcpy_ptds, dst, src, n);
}
FP_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return fp_copy(FP_cuMemcpyDtoD_v2, dst, src, n);
}
FP_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return fp_copy(FP_cuMemcpyDtoD_v2_ptds, dst, src, n);
}
typedef CUresult (*htod_fn)(CUdeviceptr, const void *, size_t);
static CUresult fp_htod(int i, CUdeviceptr dst, const void *src, size_t n) {
    htod_fn fn = (htod_fn)fp_real(i);
    if (!fn) return MISSING;
    CUresult r = fn(dst, src, n);
    if (r == CUDA_SUCCESS) fp_synced();
    return r;
}
FP_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    return fp_htod(FP_cuMemcpyHtoD_v2, dst, src, n);
}
FP_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) {
    return fp_htod(FP_cuMemcpyHtoD_v2_ptds, dst, src, n);
}
typedef CUresult (*dtoh_fn)(void *, CUdeviceptr, size_t);
static CUresult fp_dtoh(int i, void *dst, CUdeviceptr src, size_t n) {
    dtoh_fn fn = (dtoh_fn)fp_real(i);
    if (!fn) return MISSING;
    CUresult r = fn(dst, src, n);
    if (r == CUDA_SUCCESS) fp_synced();
    return r;
}
FP_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    return fp_dtoh(FP_cuMemcpyDtoH_v2, dst, src, n);
}
FP_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) {
    return fp_dtoh(FP_cuMemcpyDtoH_v2_ptds, dst, src, n);
}

