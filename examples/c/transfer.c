/* examples/c/transfer.c: two processes move bytes through hixl's C API and compare them.
 *
 * The parent forks a target (before either creates an engine), which registers a 1 MiB
 * buffer named "kv", tells the parent its address through a pipe and waits for the
 * notification "done". The parent links, WRITEs a pattern into "kv", READs it back, compares,
 * and sends "done" carrying the pattern's checksum; the target compares its own buffer, and
 * checks that "done" came from the parent's engine (its id, "127.0.0.1#<pid>").
 *
 *   cc -I crates/hixl-c/include examples/c/transfer.c -L target/release -lhixl -o transfer
 *   LD_LIBRARY_PATH=target/release ./transfer      # prints "ok", exit 0
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hixl.h"

#define SIZE (1u << 20)

static int check(uint32_t rc, const char *what) {
    if (rc != HIXL_SUCCESS) {
        fprintf(stderr, "%s: %u: %s\n", what, rc, hixl_last_error());
        exit(1);
    }
    return 0;
}

static uint64_t checksum(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

struct done { char msg[64]; char peer[64]; int seen; };

static void on_notify(void *ctx, const char *peer, const char *name, const char *msg) {
    struct done *d = ctx;
    if (strcmp(name, "done") == 0) {
        snprintf(d->msg, sizeof d->msg, "%s", msg);
        snprintf(d->peer, sizeof d->peer, "%s", peer);
        d->seen = 1;
    }
}

static int target(int out_fd) {
    HixlEngine *e = hixl_engine_new();
    check(hixl_initialize(e, "127.0.0.1:0", NULL, NULL, 0), "target initialize");
    uint8_t *kv = aligned_alloc(4096, SIZE);
    memset(kv, 0, SIZE);
    HixlMemHandle h;
    check(hixl_register(e, (uint64_t)(uintptr_t)kv, SIZE, HIXL_ACCESS_RW, "kv", &h), "register");
    char addr[64];
    size_t len;
    check(hixl_local_engine(e, addr, sizeof addr, &len), "local_engine");
    if (write(out_fd, addr, len + 1) != (ssize_t)(len + 1)) return 1;
    close(out_fd);
    struct done d = {{0}, {0}, 0};
    check(hixl_wait_notifies_from(e, 30000, "done", on_notify, &d), "wait for done");
    char mine[64], parent[64];
    snprintf(mine, sizeof mine, "%016llx", (unsigned long long)checksum(kv, SIZE));
    snprintf(parent, sizeof parent, "127.0.0.1#%d", (int)getppid());
    int ok = d.seen && strcmp(mine, d.msg) == 0 && strcmp(parent, d.peer) == 0;
    if (!ok)
        fprintf(stderr, "target: kv holds %s, %s (not %s) wrote %s\n", mine, d.peer, parent, d.msg);
    check(hixl_deregister(e, &h), "deregister");
    hixl_engine_free(e);
    free(kv);
    return ok ? 0 : 1;
}

int main(void) {
    int fds[2];
    if (pipe(fds) != 0) return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        _exit(target(fds[1]));
    }
    close(fds[1]);
    char remote[64] = {0};
    if (read(fds[0], remote, sizeof remote - 1) <= 0) return 1;

    HixlEngine *e = hixl_engine_new();
    const char *keys[] = {"hixl.backends"}, *values[] = {"auto"};
    check(hixl_initialize(e, "127.0.0.1", keys, values, 1), "initialize");
    uint8_t *src = aligned_alloc(4096, SIZE), *back = aligned_alloc(4096, SIZE);
    for (size_t i = 0; i < SIZE; i++) src[i] = (uint8_t)(i * 7 + 3);
    memset(back, 0, SIZE);
    HixlMemHandle hs, hb;
    check(hixl_register(e, (uint64_t)(uintptr_t)src, SIZE, HIXL_ACCESS_R, NULL, &hs), "register src");
    check(hixl_register(e, (uint64_t)(uintptr_t)back, SIZE, HIXL_ACCESS_RW, NULL, &hb), "register back");
    check(hixl_connect(e, remote, 10000), "connect");
    HixlRemoteRegion kv;
    check(hixl_remote_region(e, remote, "kv", &kv), "remote_region");

    /* A batch of 16 x 64 KiB WRITEs, awaited through the request. */
    HixlDesc d[16];
    for (int i = 0; i < 16; i++)
        d[i] = (HixlDesc){(uint64_t)(uintptr_t)src + i * 65536u, kv.addr + i * 65536u, 65536};
    HixlRequest *req = NULL;
    check(hixl_transfer_async(e, remote, HIXL_WRITE, d, 16, NULL, NULL, HIXL_TIMEOUT_DEFAULT, &req),
          "transfer_async");
    uint32_t state = 0;
    check(hixl_request_wait(req, HIXL_TIMEOUT_DEFAULT, &state), "wait");
    check(hixl_request_result(req), "result");
    hixl_request_free(req);
    /* READ it back in one call and compare. */
    check(hixl_get(e, remote, (uint64_t)(uintptr_t)back, kv.addr, SIZE, HIXL_TIMEOUT_DEFAULT), "get");
    if (memcmp(src, back, SIZE) != 0) {
        fprintf(stderr, "read back differs\n");
        return 1;
    }
    char stats[2048];
    size_t len;
    check(hixl_stats_json(e, stats, sizeof stats, &len), "stats");
    char sum[64];
    snprintf(sum, sizeof sum, "%016llx", (unsigned long long)checksum(src, SIZE));
    check(hixl_send_notify(e, remote, "done", sum, HIXL_TIMEOUT_DEFAULT), "send_notify");
    int status = 0;
    waitpid(pid, &status, 0);
    hixl_engine_free(e);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "the target failed\n");
        return 1;
    }
    printf("ok: hixl %s, %u bytes written, read back and verified by both processes\n", hixl_version(), SIZE);
    printf("stats: %s\n", stats);
    return 0;
}
