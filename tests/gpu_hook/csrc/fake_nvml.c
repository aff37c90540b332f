/* A fake libnvidia-ml.so.1: one device of FAKE_DEVICE_BYTES (default 1 GiB), nothing used. */
#include <stdlib.h>

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

static unsigned long long total(void) {
    const char *t = getenv("FAKE_DEVICE_BYTES");
    return t ? strtoull(t, NULL, 10) : 1ull << 30;
}
int nvmlDeviceGetMemoryInfo(void *dev, nvmlMemory_t *m) {
    (void)dev;
    m->total = m->free = total();
    m->used = 0;
    return 0;
}
int nvmlDeviceGetMemoryInfo_v2(void *dev, nvmlMemory_v2_t *m) {
    (void)dev;
    m->total = m->free = total();
    m->reserved = m->used = 0;
    return 0;
}
