/* A stand-in for a DL framework: it never links libcuda; it dlopens it and resolves the
 * driver through dlsym and cuGetProcAddress, as the CUDA runtime (hence torch) does.
 *
 *   launcher run SECONDS KERNEL_US SYNC_EVERY proc|dlsym|ptds [IDLE_US [ctx|dtoh]]
 *       launch KERNEL_US busy kernels for SECONDS, syncing every SYNC_EVERY launches (0:
 *       never) with cuCtxSynchronize or a synchronous cuMemcpyDtoH, then idling IDLE_US (a
 *       bursty, inference-like tenant); a last sync waits for the queued work (an
 *       asynchronous fake driver) before t1;
 *       prints {"launches","t0_ns","t1_ns","wall_ns","sum_kernel_ns","cublas"}
 *   launcher resolve NAME...
 *       for each driver name, what cuGetProcAddress hands out without and with the
 *       per-thread-default-stream flag: prints {NAME: [FILE, SYMBOL, FILE, SYMBOL]} (the
 *       shared object and symbol each pointer is, from dladdr; "" when not resolved)
 *   launcher memkinds CHUNK_BYTES MAX_CHUNKS
 *       allocate alternately with cuMemAllocPitch (rows of CHUNK_BYTES/4, 4 rows) and
 *       cuMemCreate until failure; prints {"ok_chunks","error","free","total",
 *       "free_after_release"}
 *   launcher mem CHUNK_BYTES MAX_CHUNKS
 *       allocate chunks until failure; prints {"ok_chunks","error","free","total",
 *       "total_mem","nvml_total","nvml_free","nvml_v2_total","free_after_release"}
 *       (nvml_* are -1 when libnvidia-ml.so.1 cannot be opened)
 * Every loop is bounded in count as well as time. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*getproc_v2_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*init_t)(unsigned);
typedef CUresult (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             void *, void **, void **);
typedef CUresult (*sync_t)(void);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*free_t)(CUdeviceptr);
typedef CUresult (*info_t)(size_t *, size_t *);
typedef CUresult (*total_t)(size_t *, int);
typedef CUresult (*dtoh_t)(void *, CUdeviceptr, size_t);
typedef CUresult (*pitch_t)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
typedef CUresult (*create_t)(unsigned long long *, size_t, const void *, unsigned long long);
typedef CUresult (*release_t)(unsigned long long);

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}
static void *h;
static getproc_v2_t getproc;
static void *resolve(const char *name, const char *how) {
    void *fn = NULL;
    if (strcmp(how, "dlsym") == 0) {
        char v2[128];
        snprintf(v2, sizeof v2, "%s_v2", name);
        fn = dlsym(h, v2);
        if (!fn) fn = dlsym(h, name);
    } else {
        int st = 0;
        unsigned long long flags = strcmp(how, "ptds") == 0 ? 2ull : 0ull;
        if (getproc(name, &fn, 12000, flags, &st) != 0) fn = NULL;
    }
    if (!fn) { fprintf(stderr, "cannot resolve %s via %s\n", name, how); exit(3); }
    return fn;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 3; }
    getproc = (getproc_v2_t)dlsym(h, "cuGetProcAddress_v2");
    if (!getproc) { fprintf(stderr, "no cuGetProcAddress_v2\n"); return 3; }
    ((init_t)resolve("cuInit", "dlsym"))(0);
    int (*cublas)(void) = (int (*)(void))dlsym(h, "cublasFakeCreate");
    if (strcmp(argv[1], "run") == 0 && argc >= 6) {
        double seconds = atof(argv[2]);
        uint64_t kernel_ns = (uint64_t)(atof(argv[3]) * 1000.0);
        long sync_every = atol(argv[4]);
        long idle_us = argc >= 7 ? atol(argv[6]) : 0;
        int by_copy = argc >= 8 && strcmp(argv[7], "dtoh") == 0;
        launch_t launch = (launch_t)resolve("cuLaunchKernel", argv[5]);
        sync_t sync = (sync_t)resolve("cuCtxSynchronize", strcmp(argv[5], "ptds") == 0 ? "proc" : argv[5]);
        dtoh_t dtoh = (dtoh_t)resolve("cuMemcpyDtoH", argv[5]);
        char host[8];
        uint64_t max_launches = (uint64_t)(seconds * 1e9 / (double)(kernel_ns ? kernel_ns : 1)) + 10;
        uint64_t t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9), n = 0;
        void *params[1] = {&kernel_ns};
        while (now_ns() < end && n < max_launches) {
            if (launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL) != 0) return 4;
            n++;
            if (sync_every > 0 && n % sync_every == 0) {
                if ((by_copy ? dtoh(host, 0, sizeof host) : sync()) != 0) return 5;
                if (idle_us > 0) {
                    struct timespec ts = {idle_us / 1000000, (idle_us % 1000000) * 1000};
                    nanosleep(&ts, NULL);
                }
            }
        }
        if (sync() != 0) return 5;
        uint64_t t1 = now_ns();
        printf("{\"launches\": %llu, \"t0_ns\": %llu, \"t1_ns\": %llu, \"wall_ns\": %llu, "
               "\"sum_kernel_ns\": %llu, \"cublas\": %d}\n",
               (unsigned long long)n, (unsigned long long)t0, (unsigned long long)t1,
               (unsigned long long)(t1 - t0),
               (unsigned long long)(n * kernel_ns), cublas ? cublas() : -1);
        return 0;
    }
    if (strcmp(argv[1], "mem") == 0 && argc >= 4) {
        size_t chunk = strtoull(argv[2], NULL, 10);
        long max_chunks = atol(argv[3]);
        alloc_t alloc = (alloc_t)resolve("cuMemAlloc", "proc");
        free_t fr = (free_t)resolve("cuMemFree", "proc");
        info_t info = (info_t)resolve("cuMemGetInfo", "dlsym");
        total_t total_mem = (total_t)resolve("cuDeviceTotalMem", "proc");
        CUdeviceptr first = 0, p = 0;
        long ok = 0;
        CUresult err = 0;
        for (; ok < max_chunks; ok++) {
            err = alloc(&p, chunk);
            if (err != 0) break;
            if (!first) first = p;
        }
        size_t f = 0, t = 0, tm = 0, f2 = 0, t2 = 0;
        info(&f, &t);
        total_mem(&tm, 0);
        long long nv_total = -1, nv_free = -1, nv2_total = -1;
        void *nv = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (nv) { /* as pynvml does: dlsym on the NVML handle */
            struct { unsigned long long total, free, used; } m1;
            struct { unsigned int version; unsigned long long total, reserved, free, used; } m2;
            int (*get1)(void *, void *) = (int (*)(void *, void *))dlsym(nv, "nvmlDeviceGetMemoryInfo");
            int (*get2)(void *, void *) = (int (*)(void *, void *))dlsym(nv, "nvmlDeviceGetMemoryInfo_v2");
            if (get1 && get1(NULL, &m1) == 0) { nv_total = (long long)m1.total; nv_free = (long long)m1.free; }
            if (get2 && get2(NULL, &m2) == 0) nv2_total = (long long)m2.total;
        }
        if (first) fr(first);
        info(&f2, &t2);
        printf("{\"ok_chunks\": %ld, \"error\": %d, \"free\": %zu, \"total\": %zu, \"total_mem\": %zu, "
               "\"nvml_total\": %lld, \"nvml_free\": %lld, \"nvml_v2_total\": %lld, "
               "\"free_after_release\": %zu}\n", ok, err, f, t, tm, nv_total, nv_free, nv2_total, f2);
        return 0;
    }
    if (strcmp(argv[1], "resolve") == 0) {
        printf("{");
        for (int a = 2; a < argc; a++) {
            const char *where[2] = {"", ""}, *sym[2] = {"", ""};
            for (int k = 0; k < 2; k++) {
                void *fn = NULL;
                int st = 0;
                Dl_info info;
                if (getproc(argv[a], &fn, 12000, k ? 2ull : 0ull, &st) == 0 && fn && dladdr(fn, &info) &&
                    info.dli_fname) {
                    where[k] = info.dli_fname;
                    sym[k] = info.dli_sname ? info.dli_sname : "";
                }
            }
            printf("%s\"%s\": [\"%s\", \"%s\", \"%s\", \"%s\"]", a > 2 ? ", " : "", argv[a], where[0],
                   sym[0], where[1], sym[1]);
        }
        printf("}\n");
        return 0;
    }
    if (strcmp(argv[1], "memkinds") == 0 && argc >= 4) {
        size_t chunk = strtoull(argv[2], NULL, 10);
        long max_chunks = atol(argv[3]);
        pitch_t pitch = (pitch_t)resolve("cuMemAllocPitch", "proc");
        create_t create = (create_t)resolve("cuMemCreate", "proc");
        release_t release = (release_t)resolve("cuMemRelease", "proc");
        info_t info = (info_t)resolve("cuMemGetInfo", "dlsym");
        unsigned long long first_handle = 0;
        long ok = 0;
        CUresult err = 0;
        for (; ok < max_chunks; ok++) {
            if (ok % 2 == 0) {
                CUdeviceptr p = 0;
                size_t pt = 0;
                err = pitch(&p, &pt, chunk / 4, 4, 4);
            } else {
                unsigned long long hd = 0;
                err = create(&hd, chunk, NULL, 0);
                if (!err && !first_handle) first_handle = hd;
            }
            if (err != 0) break;
        }
        size_t f = 0, t = 0, f2 = 0, t2 = 0;
        info(&f, &t);
        if (first_handle) release(first_handle);
        info(&f2, &t2);
        printf("{\"ok_chunks\": %ld, \"error\": %d, \"free\": %zu, \"total\": %zu, "
               "\"free_after_release\": %zu}\n", ok, err, f, t, f2);
        return 0;
    }
    return 2;
}
