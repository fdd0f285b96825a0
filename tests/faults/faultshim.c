/* LD_PRELOAD shim for the fault suite (tests/faults): disk errors and crash points by path, with
 * no hook in the product. Built by tests/faults/harness.py with `gcc -shared -fPIC -O2 -ldl`.
 *
 * Errors: while the file named by FAULTSHIM_TRIGGER exists, every write-family call
 * (write, writev, pwrite, pwrite64, pwritev, pwritev2) and every sync (fsync, fdatasync) on a file
 * descriptor whose path (readlink /proc/self/fd/N) contains FAULTSHIM_PATTERN fails with
 * FAULTSHIM_ERRNO (ENOSPC by default, or EIO). FAULTSHIM_OPS picks the families: "write", "sync"
 * or "write,sync" (default). Removing the trigger file is "space is back" / "the device healed".
 *
 * Crash points: FAULTSHIM_KILL=<op>:<pattern>:<n> sends SIGKILL to the process right after the
 * n-th successful <op> on a path containing <pattern>; <op> is unlink (unlink/unlinkat),
 * fdatasync (fdatasync/fsync), link (link/linkat) or rename (rename/renameat).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static const char *fail_pattern;
static const char *trigger;
static int fail_errno = ENOSPC;
static int fail_write = 1, fail_sync = 1;

static char kill_op[32];
static char kill_pattern[PATH_MAX];
static long kill_n;
static long kill_hits;

__attribute__((constructor)) static void shim_init(void) {
    fail_pattern = getenv("FAULTSHIM_PATTERN");
    trigger = getenv("FAULTSHIM_TRIGGER");
    const char *e = getenv("FAULTSHIM_ERRNO");
    if (e && strcmp(e, "EIO") == 0) fail_errno = EIO;
    const char *ops = getenv("FAULTSHIM_OPS");
    if (ops) {
        fail_write = strstr(ops, "write") != NULL;
        fail_sync = strstr(ops, "sync") != NULL;
    }
    const char *k = getenv("FAULTSHIM_KILL");
    if (k) {
        const char *a = strchr(k, ':');
        const char *b = a ? strrchr(k, ':') : NULL;
        if (a && b && b > a && (size_t)(a - k) < sizeof(kill_op) && (size_t)(b - a - 1) < sizeof(kill_pattern)) {
            memcpy(kill_op, k, (size_t)(a - k));
            memcpy(kill_pattern, a + 1, (size_t)(b - a - 1));
            kill_n = strtol(b + 1, NULL, 10);
        }
    }
}

static int fd_matches(int fd, const char *pattern) {
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    return strstr(path, pattern) != NULL;
}

/* 1 when a call on fd must fail now (errno is left as it was otherwise). */
static int should_fail(int fd, int is_sync) {
    if (!fail_pattern || !trigger || !(is_sync ? fail_sync : fail_write)) return 0;
    int saved = errno;
    int hit = access(trigger, F_OK) == 0 && fd_matches(fd, fail_pattern);
    errno = saved;
    return hit;
}

static void count_kill(const char *op, const char *path, int fd) {
    if (!kill_n || strcmp(op, kill_op) != 0) return;
    int saved = errno;
    int hit = path ? strstr(path, kill_pattern) != NULL : fd_matches(fd, kill_pattern);
    errno = saved;
    if (hit && __atomic_add_fetch(&kill_hits, 1, __ATOMIC_SEQ_CST) == kill_n) kill(getpid(), SIGKILL);
}

#define REAL(name) static __typeof__(name) *real_##name; if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void *buf, size_t count) {
    REAL(write);
    if (should_fail(fd, 0)) { errno = fail_errno; return -1; }
    return real_write(fd, buf, count);
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    REAL(writev);
    if (should_fail(fd, 0)) { errno = fail_errno; return -1; }
    return real_writev(fd, iov, iovcnt);
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    REAL(pwrite);
    if (should_fail(fd, 0)) { errno = fail_errno; return -1; }
    return real_pwrite(fd, buf, count, offset);
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off64_t offset) {
    REAL(pwrite64);
    if (should_fail(fd, 0)) { errno = fail_errno; return -1; }
    return real_pwrite64(fd, buf, count, offset);
}

ssize_t pwritev(int fd, const struct iovec *iov, int iovcnt, off_t offset) {
    REAL(pwritev);
    if (should_fail(fd, 0)) { errno = fail_errno; return -1; }
    return real_pwritev(fd, iov, iovcnt, offset);
}

ssize_t pwritev2(int fd, const struct iovec *iov, int iovcnt, off_t offset, int flags) {
    REAL(pwritev2);
    if (should_fail(fd, 0)) { errno = fail_errno; return -1; }
    return real_pwritev2(fd, iov, iovcnt, offset, flags);
}

int fsync(int fd) {
    REAL(fsync);
    if (should_fail(fd, 1)) { errno = fail_errno; return -1; }
    int r = real_fsync(fd);
    if (r == 0) count_kill("fdatasync", NULL, fd);
    return r;
}

int fdatasync(int fd) {
    REAL(fdatasync);
    if (should_fail(fd, 1)) { errno = fail_errno; return -1; }
    int r = real_fdatasync(fd);
    if (r == 0) count_kill("fdatasync", NULL, fd);
    return r;
}

int unlink(const char *path) {
    REAL(unlink);
    int r = real_unlink(path);
    if (r == 0) count_kill("unlink", path, -1);
    return r;
}

int unlinkat(int dirfd, const char *path, int flags) {
    REAL(unlinkat);
    int r = real_unlinkat(dirfd, path, flags);
    if (r == 0) count_kill("unlink", path, -1);
    return r;
}

int link(const char *a, const char *b) {
    REAL(link);
    int r = real_link(a, b);
    if (r == 0) count_kill("link", b, -1);
    return r;
}

int linkat(int fa, const char *a, int fb, const char *b, int flags) {
    REAL(linkat);
    int r = real_linkat(fa, a, fb, b, flags);
    if (r == 0) count_kill("link", b, -1);
    return r;
}

int rename(const char *a, const char *b) {
    REAL(rename);
    int r = real_rename(a, b);
    if (r == 0) count_kill("rename", b, -1);
    return r;
}

int renameat(int fa, const char *a, int fb, const char *b) {
    REAL(renameat);
    int r = real_renameat(fa, a, fb, b);
    if (r == 0) count_kill("rename", b, -1);
    return r;
}
