/* fp_protocol.h - the one definition of the hook <-> token-manager wire protocol.
 *
 * Transport: one persistent Unix stream socket per process (path from FP_HOOK_SOCKET).
 * Every message, in both directions, is one fixed-size struct fp_msg (64 bytes,
 * little-endian, no padding), so a reader always knows how many bytes to wait for and
 * a peer on a different version is detected on the first message.  The Python side
 * (flashpoint/gpu/token_protocol.py) packs the same layout with struct; a test compiles
 * a tiny C program that prints sizeof/offsetof from this header and compares.
 *
 * Flow (hook = client, manager = server):
 *   HELLO   hook -> mgr  once after connect: tenant, pid.  No reply.
 *   REQUEST hook -> mgr  wants a time token.  used_ns = wall time of the previous token
 *                        (grant -> end of its work), 0 if already reported.
 *                        requested_ns = predicted burst (0 = no estimate).
 *   GRANT   mgr -> hook  reply to REQUEST with the same seq; quota_ns = token length.
 *   RELEASE hook -> mgr  early return of the token (the tenant synced / went idle);
 *                        used_ns = grant -> sync return.  No reply.
 *   MEM     hook -> mgr  after every allocation or free that succeeded: mem_used_bytes =
 *                        device bytes this process holds, mem_limit_bytes = its own limit
 *                        (FP_HOOK_MEM_LIMIT_BYTES).  No reply.
 *   MEM     mgr -> hook  right after HELLO, and whenever it changes: mem_limit_bytes = the
 *                        most this process may hold = its tenant's limit minus what the
 *                        tenant's other processes reported (>= 1; 0 = no tenant limit).
 *                        The hook enforces min(its own limit, this cap) at allocation, so a
 *                        limit can be per replica (tenant) rather than per process.
 * Any malformed message (bad magic, version, type) makes the receiver close the socket;
 * the hook then fails open (grants locally) and retries connecting later.
 */
#ifndef FP_PROTOCOL_H
#define FP_PROTOCOL_H

#include <stdint.h>

#define FP_MAGIC 0x4B545046u /* "FPTK" read as little-endian bytes */
#define FP_PROTOCOL_VERSION 1u

enum fp_msg_type {
    FP_MSG_HELLO = 1,
    FP_MSG_REQUEST = 2,
    FP_MSG_GRANT = 3,
    FP_MSG_RELEASE = 4,
    FP_MSG_MEM = 5,
};

struct fp_msg {
    uint32_t magic;          /*  0: FP_MAGIC */
    uint16_t version;        /*  4: FP_PROTOCOL_VERSION */
    uint16_t type;           /*  6: enum fp_msg_type */
    uint32_t tenant;         /*  8: tenant id (FP_HOOK_TENANT) */
    uint32_t pid;            /* 12: sender's pid (hook) or 0 (manager) */
    uint64_t seq;            /* 16: per-connection sequence; GRANT echoes REQUEST's */
    uint64_t used_ns;        /* 24: REQUEST/RELEASE: wall time the last token was used */
    uint64_t requested_ns;   /* 32: REQUEST: predicted burst length, 0 = unknown */
    uint64_t quota_ns;       /* 40: GRANT: token length granted */
    uint64_t mem_used_bytes; /* 48: MEM: device bytes this process holds */
    uint64_t mem_limit_bytes;/* 56: HELLO/MEM: this process's memory limit (0 = none) */
};

#define FP_MSG_SIZE 64

#endif
