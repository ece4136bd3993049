/* iofault.so: an LD_PRELOAD fault injector for file-system calls, SQLite-style: fail exactly the Nth
 * call (counted across the process and its children) that writes under the watched directories, with
 * the errno asked for.
 *
 * Why not libfiu's posix preload (Debian fiu-utils): it has no Nth-call mode and no way to scope a
 * fault point to some files, so "posix/io/rw/write" also fails libzmq's eventfd writes (libzmq aborts
 * at signaler.cpp) and Python's own stderr; and it wraps neither mkdir, openat, renameat, unlinkat nor
 * sendfile, which Python's os and shutil call.
 *
 * Control: MODELCACHE_IOFAULT names a file of `struct control` (tests/iofault/__init__.py writes it),
 * mapped shared, so the test arms and disarms a fault in a running daemon (as fiu-ctrl does) and reads
 * back which call it failed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define OP_OPEN 1      /* open for writing (O_WRONLY, O_RDWR, O_CREAT, O_TRUNC) */
#define OP_WRITE 2     /* write, pwrite, writev, pwritev, sendfile, copy_file_range, ftruncate, fallocate */
#define OP_FSYNC 4     /* fsync, fdatasync */
#define OP_RENAME 8    /* rename, renameat, renameat2 */
#define OP_UNLINK 16   /* unlink, unlinkat, rmdir, remove */
#define OP_MKDIR 32    /* mkdir, mkdirat */
#define PREFIXES 6
#define MAGIC 0x10fa0175u

struct control {
    uint32_t magic;
    int32_t armed;
    int32_t nth;               /* fail the nth matching call, 1-based */
    int32_t err;               /* with this errno */
    uint32_t ops;              /* which kinds of call count */
    int32_t count;             /* matching calls seen since armed */
    int32_t fired;             /* faults injected since armed */
    int32_t pad;
    char what[512];            /* "<call> <path>" of the call that was failed */
    char prefixes[PREFIXES][512];
};

static struct control *ctl;
static int ctl_state;          /* 0: not looked at yet, 1: mapped, -1: none */

static void init(void) {
    const char *path = getenv("MODELCACHE_IOFAULT");
    ctl_state = -1;
    if (!path || !*path)
        return;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    void *p = mmap(NULL, sizeof(struct control), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    syscall(SYS_close, fd);
    if (p == MAP_FAILED || ((struct control *)p)->magic != MAGIC)
        return;
    ctl = p;
    ctl_state = 1;
}

static int armed_for(unsigned op) {
    if (ctl_state == 0)
        init();
    return ctl_state == 1 && __atomic_load_n(&ctl->armed, __ATOMIC_ACQUIRE) && (ctl->ops & op);
}

static int under_prefix(const char *path) {
    for (int i = 0; i < PREFIXES; i++) {
        const char *pre = ctl->prefixes[i];
        size_t n = strnlen(pre, sizeof ctl->prefixes[i]);
        if (n && strncmp(path, pre, n) == 0 && (path[n] == '/' || path[n] == '\0'))
            return 1;
    }
    return 0;
}

/* The absolute path `name` names, relative to dirfd (AT_FDCWD: the working directory). */
static int resolve(int dirfd, const char *name, char *out, size_t size) {
    if (!name)
        return 0;
    if (name[0] == '/') {
        snprintf(out, size, "%s", name);
        return 1;
    }
    char base[PATH_MAX];
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof base))
            return 0;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n < 0)
            return 0;
        base[n] = '\0';
    }
    snprintf(out, size, "%s/%s", base, name);
    return 1;
}

static int fd_path(int fd, char *out, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, size - 1);
    if (n < 0)
        return 0;
    out[n] = '\0';
    return 1;
}

/* Whether this call is the one to fail: counts it when it matches; sets errno when it is. */
static int fault(unsigned op, const char *call, const char *path) {
    if (!under_prefix(path))
        return 0;
    int n = __atomic_add_fetch(&ctl->count, 1, __ATOMIC_ACQ_REL);
    if (n != ctl->nth)
        return 0;
    __atomic_add_fetch(&ctl->fired, 1, __ATOMIC_ACQ_REL);
    snprintf(ctl->what, sizeof ctl->what, "%s %s", call, path);
    errno = ctl->err;
    return 1;
}

static int fault_at(unsigned op, const char *call, int dirfd, const char *name) {
    char path[PATH_MAX + 256];
    if (!armed_for(op) || !resolve(dirfd, name, path, sizeof path))
        return 0;
    return fault(op, call, path);
}

static int fault_fd(unsigned op, const char *call, int fd) {
    char path[PATH_MAX];
    if (!armed_for(op) || !fd_path(fd, path, sizeof path))
        return 0;
    return fault(op, call, path);
}

static int writes(int flags) {
    return (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC)) != 0;
}

#define REAL(name) static __typeof__(name) *real; if (!real) real = dlsym(RTLD_NEXT, #name)

#define OPEN_LIKE(name, atfd)                                                   \
    int name(const char *path, int flags, ...) {                                \
        REAL(name);                                                             \
        mode_t mode = 0;                                                        \
        if (flags & (O_CREAT | __O_TMPFILE)) {                                  \
            va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); \
        }                                                                       \
        if (writes(flags) && fault_at(OP_OPEN, #name, atfd, path))             \
            return -1;                                                          \
        return real(path, flags, mode);                                         \
    }
OPEN_LIKE(open, AT_FDCWD)
OPEN_LIKE(open64, AT_FDCWD)

#define OPENAT_LIKE(name)                                                       \
    int name(int dirfd, const char *path, int flags, ...) {                     \
        REAL(name);                                                             \
        mode_t mode = 0;                                                        \
        if (flags & (O_CREAT | __O_TMPFILE)) {                                  \
            va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); \
        }                                                                       \
        if (writes(flags) && fault_at(OP_OPEN, #name, dirfd, path))            \
            return -1;                                                          \
        return real(dirfd, path, flags, mode);                                  \
    }
OPENAT_LIKE(openat)
OPENAT_LIKE(openat64)

int __open_2(const char *path, int flags) {
    REAL(__open_2);
    if (writes(flags) && fault_at(OP_OPEN, "open", AT_FDCWD, path)) return -1;
    return real(path, flags);
}
int __open64_2(const char *path, int flags) {
    REAL(__open64_2);
    if (writes(flags) && fault_at(OP_OPEN, "open", AT_FDCWD, path)) return -1;
    return real(path, flags);
}
int creat(const char *path, mode_t mode) {
    REAL(creat);
    if (fault_at(OP_OPEN, "creat", AT_FDCWD, path)) return -1;
    return real(path, mode);
}
int creat64(const char *path, mode_t mode) {
    REAL(creat64);
    if (fault_at(OP_OPEN, "creat", AT_FDCWD, path)) return -1;
    return real(path, mode);
}
FILE *fopen(const char *path, const char *mode) {
    REAL(fopen);
    if (strpbrk(mode, "wa+") && fault_at(OP_OPEN, "fopen", AT_FDCWD, path)) return NULL;
    return real(path, mode);
}
FILE *fopen64(const char *path, const char *mode) {
    REAL(fopen64);
    if (strpbrk(mode, "wa+") && fault_at(OP_OPEN, "fopen", AT_FDCWD, path)) return NULL;
    return real(path, mode);
}

ssize_t write(int fd, const void *buf, size_t n) {
    REAL(write);
    if (fault_fd(OP_WRITE, "write", fd)) return -1;
    return real(fd, buf, n);
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    REAL(pwrite);
    if (fault_fd(OP_WRITE, "pwrite", fd)) return -1;
    return real(fd, buf, n, off);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t off) {
    REAL(pwrite64);
    if (fault_fd(OP_WRITE, "pwrite", fd)) return -1;
    return real(fd, buf, n, off);
}
ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    REAL(writev);
    if (fault_fd(OP_WRITE, "writev", fd)) return -1;
    return real(fd, iov, cnt);
}
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    REAL(pwritev);
    if (fault_fd(OP_WRITE, "pwritev", fd)) return -1;
    return real(fd, iov, cnt, off);
}
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off64_t off) {
    REAL(pwritev64);
    if (fault_fd(OP_WRITE, "pwritev", fd)) return -1;
    return real(fd, iov, cnt, off);
}
ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {
    REAL(pwritev2);
    if (fault_fd(OP_WRITE, "pwritev2", fd)) return -1;
    return real(fd, iov, cnt, off, flags);
}
ssize_t sendfile(int out, int in, off_t *off, size_t n) {
    REAL(sendfile);
    if (fault_fd(OP_WRITE, "sendfile", out)) return -1;
    return real(out, in, off, n);
}
ssize_t sendfile64(int out, int in, off64_t *off, size_t n) {
    REAL(sendfile64);
    if (fault_fd(OP_WRITE, "sendfile", out)) return -1;
    return real(out, in, off, n);
}
ssize_t copy_file_range(int in, off64_t *inoff, int out, off64_t *outoff, size_t n, unsigned int flags) {
    REAL(copy_file_range);
    if (fault_fd(OP_WRITE, "copy_file_range", out)) return -1;
    return real(in, inoff, out, outoff, n, flags);
}
int ftruncate(int fd, off_t len) {
    REAL(ftruncate);
    if (fault_fd(OP_WRITE, "ftruncate", fd)) return -1;
    return real(fd, len);
}
int ftruncate64(int fd, off64_t len) {
    REAL(ftruncate64);
    if (fault_fd(OP_WRITE, "ftruncate", fd)) return -1;
    return real(fd, len);
}
int fallocate(int fd, int mode, off_t off, off_t len) {
    REAL(fallocate);
    if (fault_fd(OP_WRITE, "fallocate", fd)) return -1;
    return real(fd, mode, off, len);
}
int posix_fallocate(int fd, off_t off, off_t len) {
    REAL(posix_fallocate);
    if (fault_fd(OP_WRITE, "posix_fallocate", fd)) return ctl->err;   /* (returns the error, not -1) */
    return real(fd, off, len);
}
int posix_fallocate64(int fd, off64_t off, off64_t len) {
    REAL(posix_fallocate64);
    if (fault_fd(OP_WRITE, "posix_fallocate", fd)) return ctl->err;
    return real(fd, off, len);
}

int fsync(int fd) {
    REAL(fsync);
    if (fault_fd(OP_FSYNC, "fsync", fd)) return -1;
    return real(fd);
}
int fdatasync(int fd) {
    REAL(fdatasync);
    if (fault_fd(OP_FSYNC, "fdatasync", fd)) return -1;
    return real(fd);
}

int rename(const char *a, const char *b) {
    REAL(rename);
    if (fault_at(OP_RENAME, "rename", AT_FDCWD, a)) return -1;
    return real(a, b);
}
int renameat(int da, const char *a, int db, const char *b) {
    REAL(renameat);
    if (fault_at(OP_RENAME, "renameat", da, a)) return -1;
    return real(da, a, db, b);
}
int renameat2(int da, const char *a, int db, const char *b, unsigned int flags) {
    REAL(renameat2);
    if (fault_at(OP_RENAME, "renameat2", da, a)) return -1;
    return real(da, a, db, b, flags);
}

int unlink(const char *path) {
    REAL(unlink);
    if (fault_at(OP_UNLINK, "unlink", AT_FDCWD, path)) return -1;
    return real(path);
}
int unlinkat(int dirfd, const char *path, int flags) {
    REAL(unlinkat);
    if (fault_at(OP_UNLINK, "unlinkat", dirfd, path)) return -1;
    return real(dirfd, path, flags);
}
int rmdir(const char *path) {
    REAL(rmdir);
    if (fault_at(OP_UNLINK, "rmdir", AT_FDCWD, path)) return -1;
    return real(path);
}
int remove(const char *path) {
    REAL(remove);
    if (fault_at(OP_UNLINK, "remove", AT_FDCWD, path)) return -1;
    return real(path);
}

int mkdir(const char *path, mode_t mode) {
    REAL(mkdir);
    if (fault_at(OP_MKDIR, "mkdir", AT_FDCWD, path)) return -1;
    return real(path, mode);
}
int mkdirat(int dirfd, const char *path, mode_t mode) {
    REAL(mkdirat);
    if (fault_at(OP_MKDIR, "mkdirat", dirfd, path)) return -1;
    return real(dirfd, path, mode);
}
