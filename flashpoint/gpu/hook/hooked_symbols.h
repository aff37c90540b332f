/* hooked_symbols.h - the ONE list of interposed symbols (an X-macro).
 *
 * FP_SYM(symbol, proc_name, ptds)
 *   symbol     the exported name the hook defines (and resolves in libcuda/libnvidia-ml)
 *   proc_name  the name cuGetProcAddress is asked for ("cuMemAlloc" yields the _v2 ABI),
 *              or NULL if that symbol is never handed out by cuGetProcAddress
 *   ptds       1 for the per-thread-default-stream (_ptsz/_ptds) variant that
 *              cuGetProcAddress returns when CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 *              is set, else 0
 * fp_hook_internal.h expands it into the enum, fp_hook.c into the name tables and the
 * dispatch table used by the dlsym and cuGetProcAddress hooks, so nothing is kept in sync
 * by hand.
 */
/* time-token gates */
FP_SYM(cuLaunchKernel, "cuLaunchKernel", 0)
FP_SYM(cuLaunchKernel_ptsz, "cuLaunchKernel", 1)
FP_SYM(cuLaunchKernelEx, "cuLaunchKernelEx", 0)
FP_SYM(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 1)
FP_SYM(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 0)
FP_SYM(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 1)
FP_SYM(cuGraphLaunch, "cuGraphLaunch", 0)
FP_SYM(cuGraphLaunch_ptsz, "cuGraphLaunch", 1)
/* sync points: usage measurement and early token return */
FP_SYM(cuCtxSynchronize, "cuCtxSynchronize", 0)
FP_SYM(cuStreamSynchronize, "cuStreamSynchronize", 0)
FP_SYM(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 1)
FP_SYM(cuEventSynchronize, "cuEventSynchronize", 0)
/* synchronous copies wait for the work queued before them (FaST-GShare hooks them too) */
FP_SYM(cuMemcpy, "cuMemcpy", 0)
FP_SYM(cuMemcpy_ptds, "cuMemcpy", 1)
FP_SYM(cuMemcpyHtoD_v2, "cuMemcpyHtoD", 0)
FP_SYM(cuMemcpyHtoD_v2_ptds, "cuMemcpyHtoD", 1)
FP_SYM(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 0)
FP_SYM(cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH", 1)
FP_SYM(cuMemcpyDtoD_v2, "cuMemcpyDtoD", 0)
FP_SYM(cuMemcpyDtoD_v2_ptds, "cuMemcpyDtoD", 1)
/* memory accounting and limits (v1 exports are the 32-bit legacy ABI) */
FP_SYM(cuMemAlloc, NULL, 0)
FP_SYM(cuMemAlloc_v2, "cuMemAlloc", 0)
FP_SYM(cuMemAllocPitch, NULL, 0)
FP_SYM(cuMemAllocPitch_v2, "cuMemAllocPitch", 0)
FP_SYM(cuMemAllocManaged, "cuMemAllocManaged", 0)
FP_SYM(cuMemAllocAsync, "cuMemAllocAsync", 0)
FP_SYM(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 1)
FP_SYM(cuMemCreate, "cuMemCreate", 0)
FP_SYM(cuMemFree, NULL, 0)
FP_SYM(cuMemFree_v2, "cuMemFree", 0)
FP_SYM(cuMemFreeAsync, "cuMemFreeAsync", 0)
FP_SYM(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 1)
FP_SYM(cuMemRelease, "cuMemRelease", 0)
/* reporting the limit */
FP_SYM(cuMemGetInfo, NULL, 0)
FP_SYM(cuMemGetInfo_v2, "cuMemGetInfo", 0)
FP_SYM(cuDeviceTotalMem, NULL, 0)
FP_SYM(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 0)
/* symbol resolution */
FP_SYM(cuGetProcAddress, NULL, 0)
FP_SYM(cuGetProcAddress_v2, "cuGetProcAddress", 0)
/* NVML (resolved in libnvidia-ml.so.1, never through cuGetProcAddress) */
FP_SYM(nvmlDeviceGetMemoryInfo, NULL, 0)
FP_SYM(nvmlDeviceGetMemoryInfo_v2, NULL, 0)
