/* An application linked against libcuda.so.1 that calls the driver directly (plain symbol
 * interposition by LD_PRELOAD, no dlsym), and that forks after its first launch.
 *   linked SECONDS  -> parent and child each launch 1 ms kernels for SECONDS and print
 *                      {"who","launches","wall_ns"}; the child's fake-driver stats go to
 *                      $FAKE_CUDA_STATS.child */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
CUresult cuInit(unsigned);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                        void **, void **);
CUresult cuCtxSynchronize(void);

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static int run(const char *who, double seconds) {
    uint64_t kernel_ns = 1000000, t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9), n = 0;
    void *params[1] = {&kernel_ns};
    while (now_ns() < end && n < 100000) {
        if (cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL) != 0) return 4;
        if (++n % 4 == 0 && cuCtxSynchronize() != 0) return 5;
    }
    printf("{\"who\": \"%s\", \"launches\": %llu, \"wall_ns\": %llu}\n", who, (unsigned long long)n,
           (unsigned long long)(now_ns() - t0));
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    double seconds = atof(argv[1]);
    cuInit(0);
    uint64_t k = 1000000;
    void *params[1] = {&k};
    cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL); /* now holding a token */
    pid_t pid = fork();
    if (pid < 0) return 6;
    if (pid == 0) {
        char path[4096];
        const char *s = getenv("FAKE_CUDA_STATS");
        if (s) {
            snprintf(path, sizeof path, "%s.child", s);
            setenv("FAKE_CUDA_STATS", path, 1);
        }
        exit(run("child", seconds));
    }
    int rc = run("parent", seconds), status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 7;
    return rc;
}
