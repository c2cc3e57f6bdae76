/* A power-cut simulator, loaded with LD_PRELOAD into a child process by
 * tests/power_cuts.rs (built there with `cc`).
 *
 * Before every change to a file under PC_DIR (pwrite64/pwrite/write/writev/
 * pwritev, ftruncate/ftruncate64, fallocate, a creation by open/openat) it
 * appends an undo record to PC_UNDO: the old length, the old bytes the
 * write covers (and, with PC_KEEP_NEW, the new ones). fsync/fdatasync of a
 * file appends a sync record (by inode, whichever fd), fsync of the
 * directory a directory-sync record. The undo log is written without
 * syncing: the simulated cut is a SIGKILL, after which the page cache
 * survives, so the parent reads it and rolls back every change no later
 * sync covers (tests/powercut/undo.rs).
 *
 * The cut: the child raises SIGKILL before the PC_CUT_AT-th intercepted
 * operation whose phase is in the PC_CUT_PHASES mask and whose class is in
 * the PC_CUT_CLASSES mask. The child names its phase by opening
 * "<PC_CTL>phase-<n>" (refused with ENOENT). Syncs of tracked files are
 * not passed to the kernel (durability is what the undo log says), unless
 * PC_REAL_SYNC is set (a simulated sync takes PC_SYNC_US microseconds,
 * default 300). With PC_COUNTS, the operations counted per phase and
 * class are written there when the process exits (a calibration run).
 * unlink/rename of a tracked file are recorded too (the parent refuses to
 * roll them back: the engine is not expected to do either here).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { K_WRITE = 1, K_TRUNC = 2, K_SYNC = 3, K_CREATE = 4, K_DIRSYNC = 5,
       K_UNLINK = 6, K_RENAME = 7, K_CUT = 8 };
/* Operation classes (see power_cuts.rs, `Class`). */
enum { C_APPEND = 0, C_JSYNC = 1, C_GROWTH = 2, C_DBWRITE = 3, C_DBSYNC = 4,
       C_RESTART = 5, C_NAMESPACE = 6, C_OTHER = 7, NCLASS = 8 };
#define NPHASE 8
#define JOURNAL_HEADER 4096

struct rec {
    uint32_t kind, cls, phase, pad;
    uint64_t dev, ino, off, old_size, new_size, old_len, new_len;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int undo_fd = -1;
static char dir[PATH_MAX];
static size_t dir_len;
static char ctl[PATH_MAX];
static int phase;
static long counts[NPHASE][NCLASS];
static long cut_phases = -1, cut_classes = -1, cut_at, matched;
static int keep_new, real_sync;
static long sync_us = 300;
/* Records written so far: a sync record holds the count at the sync's
 * entry, and covers only the records before it. */
static uint64_t seq;
static const char *counts_path;
/* PC_DROP_SYNCS=<suffix>: syncs of files so named, in the work phase (3),
 * cover nothing (a control: an engine that answered without syncing them
 * must fail the audit). */
static const char *drop_syncs;

static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_pwritev)(int, const struct iovec *, int, off_t);
static int (*real_ftruncate)(int, off_t);
static int (*real_ftruncate64)(int, off_t);
static int (*real_fallocate)(int, int, off_t, off_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static int (*real_unlink)(const char *);
static int (*real_unlinkat)(int, const char *, int);
static int (*real_rename)(const char *, const char *);
static int (*real_renameat)(int, const char *, int, const char *);

#define RESOLVE(name) real_##name = dlsym(RTLD_NEXT, #name)

__attribute__((constructor)) static void init(void) {
    RESOLVE(write); RESOLVE(pwrite64); RESOLVE(pwrite); RESOLVE(writev);
    RESOLVE(pwritev); RESOLVE(ftruncate); RESOLVE(ftruncate64);
    RESOLVE(fallocate); RESOLVE(fsync); RESOLVE(fdatasync); RESOLVE(open);
    RESOLVE(open64); RESOLVE(openat); RESOLVE(openat64); RESOLVE(unlink);
    RESOLVE(unlinkat); RESOLVE(rename); RESOLVE(renameat);
    const char *d = getenv("PC_DIR"), *u = getenv("PC_UNDO"), *c = getenv("PC_CTL");
    if (!d || !u || !realpath(d, dir)) return;
    dir_len = strlen(dir);
    if (c) snprintf(ctl, sizeof ctl, "%s", c);
    undo_fd = real_open(u, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const char *v;
    if ((v = getenv("PC_CUT_PHASES"))) cut_phases = atol(v);
    if ((v = getenv("PC_CUT_CLASSES"))) cut_classes = atol(v);
    if ((v = getenv("PC_CUT_AT"))) cut_at = atol(v);
    keep_new = getenv("PC_KEEP_NEW") != NULL;
    real_sync = getenv("PC_REAL_SYNC") != NULL;
    counts_path = getenv("PC_COUNTS");
    if ((v = getenv("PC_SYNC_US"))) sync_us = atol(v);
    drop_syncs = getenv("PC_DROP_SYNCS");
}

__attribute__((destructor)) static void fini(void) {
    if (!counts_path) return;
    FILE *f = fopen(counts_path, "w");
    if (!f) return;
    for (int p = 0; p < NPHASE; p++)
        for (int c = 0; c < NCLASS; c++)
            fprintf(f, "%d %d %ld\n", p, c, counts[p][c]);
    fclose(f);
}

static void put(const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = real_write(undo_fd, p, len);
        if (n <= 0) {
            if (n < 0 && errno == EINTR) continue;
            abort(); /* an undo log with a hole would make the test lie */
        }
        p += n;
        len -= (size_t)n;
    }
}

static void record(struct rec *r, const void *old, const void *new_) {
    r->phase = (uint32_t)phase;
    seq++;
    put(r, sizeof *r);
    if (r->old_len) put(old, r->old_len);
    if (r->new_len) put(new_, r->new_len);
}

/* 0: not under the directory; 1: a file under it; 2: the directory. */
static int tracked_path(const char *path) {
    if (undo_fd < 0 || strncmp(path, dir, dir_len) != 0) return 0;
    if (path[dir_len] == 0) return 2;
    return path[dir_len] == '/' ? 1 : 0;
}

static int fd_path(int fd, char *path) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, PATH_MAX - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    return tracked_path(path);
}

static int ends_with(const char *s, const char *tail) {
    size_t a = strlen(s), b = strlen(tail);
    return a >= b && strcmp(s + a - b, tail) == 0;
}

/* Counts the operation; raises SIGKILL if it is the one to cut at. Called
 * with the lock held, before the operation. */
static void tick(int cls) {
    counts[phase][cls]++;
    if (cut_at <= 0) return;
    if (!((cut_phases >> phase) & 1) || !((cut_classes >> cls) & 1)) return;
    if (++matched == cut_at) {
        struct rec r = {0};
        r.kind = K_CUT;
        r.cls = (uint32_t)cls;
        record(&r, NULL, NULL);
        raise(SIGKILL);
    }
}

/* Records a write of `len` bytes at `off` (-1: the fd's position, or the
 * end with O_APPEND) and returns with the lock held if the fd is tracked
 * (1), else 0 without the lock. `data` may be NULL (writev: `iov`). */
static int before_write(int fd, off_t off, const void *data, const struct iovec *iov,
                        int iovcnt, size_t len) {
    char path[PATH_MAX];
    if (undo_fd < 0 || fd == undo_fd || fd_path(fd, path) != 1) return 0;
    pthread_mutex_lock(&lock);
    struct stat st;
    if (fstat(fd, &st) != 0) return 1;
    if (off < 0) {
        int fl = fcntl(fd, F_GETFL);
        off = (fl >= 0 && (fl & O_APPEND)) ? st.st_size : lseek(fd, 0, SEEK_CUR);
    }
    uint64_t end = (uint64_t)off + len;
    int journal = ends_with(path, ".journal");
    int cls;
    if (end > (uint64_t)st.st_size) cls = C_GROWTH;
    else if (journal && (off == 0 || off == JOURNAL_HEADER)) cls = C_RESTART;
    else if (journal) cls = C_APPEND;
    else if (ends_with(path, ".redb")) cls = C_DBWRITE;
    else cls = C_OTHER;
    tick(cls);
    struct rec r = {0};
    r.kind = K_WRITE;
    r.cls = (uint32_t)cls;
    r.dev = st.st_dev;
    r.ino = st.st_ino;
    r.off = (uint64_t)off;
    r.old_size = (uint64_t)st.st_size;
    r.new_size = end > (uint64_t)st.st_size ? end : (uint64_t)st.st_size;
    char *old = NULL, *new_ = NULL;
    if ((uint64_t)off < (uint64_t)st.st_size) {
        uint64_t n = (uint64_t)st.st_size - (uint64_t)off;
        if (n > len) n = len;
        old = malloc(n ? n : 1);
        if (!old) abort();
        ssize_t got = pread(fd, old, n, off);
        if (got < 0) {
            /* A write-only fd: read through a fresh one. */
            char link[64];
            snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
            int rfd = real_open(link, O_RDONLY | O_CLOEXEC);
            got = rfd >= 0 ? pread(rfd, old, n, off) : -1;
            if (rfd >= 0) close(rfd);
        }
        if (got != (ssize_t)n) abort();
        r.old_len = n;
    }
    if (keep_new) {
        new_ = malloc(len ? len : 1);
        if (!new_) abort();
        if (data) memcpy(new_, data, len);
        else {
            size_t at = 0;
            for (int i = 0; i < iovcnt; i++) {
                memcpy(new_ + at, iov[i].iov_base, iov[i].iov_len);
                at += iov[i].iov_len;
            }
        }
        r.new_len = len;
    }
    record(&r, old, new_);
    free(old);
    free(new_);
    return 1;
}

static size_t iov_len(const struct iovec *iov, int n) {
    size_t len = 0;
    for (int i = 0; i < n; i++) len += iov[i].iov_len;
    return len;
}

#define UNLOCK_AND_RETURN(held, expr) do { \
    __typeof__(expr) result_ = (expr); \
    int saved_ = errno; \
    if (held) pthread_mutex_unlock(&lock); \
    errno = saved_; \
    return result_; } while (0)

ssize_t write(int fd, const void *buf, size_t n) {
    int held = before_write(fd, -1, buf, NULL, 0, n);
    UNLOCK_AND_RETURN(held, real_write(fd, buf, n));
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    int held = before_write(fd, off, buf, NULL, 0, n);
    UNLOCK_AND_RETURN(held, real_pwrite64(fd, buf, n, off));
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    int held = before_write(fd, off, buf, NULL, 0, n);
    UNLOCK_AND_RETURN(held, real_pwrite(fd, buf, n, off));
}
ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    int held = before_write(fd, -1, NULL, iov, cnt, iov_len(iov, cnt));
    UNLOCK_AND_RETURN(held, real_writev(fd, iov, cnt));
}
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    int held = before_write(fd, off, NULL, iov, cnt, iov_len(iov, cnt));
    UNLOCK_AND_RETURN(held, real_pwritev(fd, iov, cnt, off));
}
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t off) {
    return pwritev(fd, iov, cnt, off);
}

/* A change of length (ftruncate, fallocate); the lock is held on return 1. */
static int before_resize(int fd, uint64_t new_size) {
    char path[PATH_MAX];
    if (undo_fd < 0 || fd_path(fd, path) != 1) return 0;
    pthread_mutex_lock(&lock);
    struct stat st;
    if (fstat(fd, &st) != 0) return 1;
    if (new_size == (uint64_t)st.st_size) return 1;
    tick(new_size > (uint64_t)st.st_size ? C_GROWTH : C_OTHER);
    struct rec r = {0};
    r.kind = K_TRUNC;
    r.cls = new_size > (uint64_t)st.st_size ? C_GROWTH : C_OTHER;
    r.dev = st.st_dev;
    r.ino = st.st_ino;
    r.off = new_size;
    r.old_size = (uint64_t)st.st_size;
    r.new_size = new_size;
    char *old = NULL;
    if (new_size < (uint64_t)st.st_size) {
        uint64_t n = (uint64_t)st.st_size - new_size;
        old = malloc(n);
        if (!old || pread(fd, old, n, (off_t)new_size) != (ssize_t)n) abort();
        r.old_len = n;
    }
    record(&r, old, NULL);
    free(old);
    return 1;
}

int ftruncate(int fd, off_t len) {
    int held = before_resize(fd, (uint64_t)len);
    UNLOCK_AND_RETURN(held, real_ftruncate(fd, len));
}
int ftruncate64(int fd, off_t len) {
    int held = before_resize(fd, (uint64_t)len);
    UNLOCK_AND_RETURN(held, real_ftruncate64(fd, len));
}
int fallocate(int fd, int mode, off_t off, off_t len) {
    struct stat st;
    int held = 0;
    if (mode == 0 && fstat(fd, &st) == 0 && (uint64_t)(off + len) > (uint64_t)st.st_size)
        held = before_resize(fd, (uint64_t)(off + len));
    UNLOCK_AND_RETURN(held, real_fallocate(fd, mode, off, len));
}
int fallocate64(int fd, int mode, off_t off, off_t len) {
    return fallocate(fd, mode, off, len);
}

/* A sync covers what was written before it began: the record, written
 * when it returns, holds the count of records at its entry. Between the
 * two it takes PC_SYNC_US microseconds (a disk's flush), during which
 * other threads go on writing, as they do with a real disk. */
static int synced(int fd, int (*real)(int)) {
    char path[PATH_MAX];
    int t = undo_fd >= 0 ? fd_path(fd, path) : 0;
    if (!t) return real(fd);
    struct stat st;
    if (fstat(fd, &st) != 0) return real(fd);
    int cls = t == 2 ? C_NAMESPACE : ends_with(path, ".journal") ? C_JSYNC
            : ends_with(path, ".redb") ? C_DBSYNC : C_OTHER;
    pthread_mutex_lock(&lock);
    tick(cls);
    uint64_t entry = seq;
    pthread_mutex_unlock(&lock);
    int rc = real_sync ? real(fd) : 0;
    int saved = errno;
    if (!real_sync && sync_us > 0) usleep((useconds_t)sync_us);
    if (rc == 0 && !(drop_syncs && phase == 3 && ends_with(path, drop_syncs))) {
        pthread_mutex_lock(&lock);
        struct rec r = {0};
        r.kind = t == 2 ? K_DIRSYNC : K_SYNC;
        r.cls = (uint32_t)cls;
        r.dev = st.st_dev;
        r.ino = st.st_ino;
        r.off = entry;
        record(&r, NULL, NULL);
        pthread_mutex_unlock(&lock);
    }
    errno = saved;
    return rc;
}
int fsync(int fd) { return synced(fd, real_fsync); }
int fdatasync(int fd) { return synced(fd, real_fdatasync); }

/* The absolute form of `path` (relative to `at`), its parent resolved. */
static int absolute(int at, const char *path, char *out) {
    char joined[2 * PATH_MAX + 2], parent[PATH_MAX];
    if (path[0] == '/') snprintf(joined, sizeof joined, "%s", path);
    else if (at == AT_FDCWD) {
        if (!getcwd(parent, sizeof parent)) return 0;
        snprintf(joined, sizeof joined, "%s/%s", parent, path);
    } else {
        char link[64], base[PATH_MAX];
        snprintf(link, sizeof link, "/proc/self/fd/%d", at);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n <= 0) return 0;
        base[n] = 0;
        snprintf(joined, sizeof joined, "%s/%s", base, path);
    }
    char *slash = strrchr(joined, '/');
    if (!slash) return 0;
    *slash = 0;
    if (!realpath(joined[0] ? joined : "/", parent)) return 0;
    if (strlen(parent) + strlen(slash + 1) + 2 > PATH_MAX) return 0;
    memcpy(out, parent, strlen(parent));
    out[strlen(parent)] = '/';
    strcpy(out + strlen(parent) + 1, slash + 1);
    return 1;
}

/* Phase markers and creations; returns -2 to go on with the real open. */
static int opening(int at, const char *path, int flags, int (*do_open)(void *), void *arg) {
    if (ctl[0] && strncmp(path, ctl, strlen(ctl)) == 0) {
        const char *p = strstr(path + strlen(ctl), "phase-");
        if (p) {
            pthread_mutex_lock(&lock);
            phase = atoi(p + 6) % NPHASE;
            pthread_mutex_unlock(&lock);
        }
        errno = ENOENT;
        return -1;
    }
    char abs_path[PATH_MAX];
    if (!(flags & O_CREAT) || undo_fd < 0 || !absolute(at, path, abs_path) ||
        tracked_path(abs_path) != 1)
        return -2;
    pthread_mutex_lock(&lock);
    struct stat st;
    int existed = stat(abs_path, &st) == 0;
    if (!existed) tick(C_NAMESPACE);
    int fd = do_open(arg);
    int saved = errno;
    if (fd >= 0 && !existed && fstat(fd, &st) == 0) {
        char parent[PATH_MAX];
        snprintf(parent, sizeof parent, "%s", abs_path);
        *strrchr(parent, '/') = 0;
        struct stat pst;
        const char *name = abs_path + dir_len + 1;
        struct rec r = {0};
        r.kind = K_CREATE;
        r.cls = C_NAMESPACE;
        r.dev = st.st_dev;
        r.ino = st.st_ino;
        r.off = stat(parent, &pst) == 0 ? pst.st_ino : 0;
        r.new_len = strlen(name);
        record(&r, NULL, name);
    }
    pthread_mutex_unlock(&lock);
    errno = saved;
    return fd;
}

struct open_args { int at; const char *path; int flags; mode_t mode; int which; };
static int do_open(void *p) {
    struct open_args *a = p;
    switch (a->which) {
    case 0: return real_open(a->path, a->flags, a->mode);
    case 1: return real_open64(a->path, a->flags, a->mode);
    case 2: return real_openat(a->at, a->path, a->flags, a->mode);
    default: return real_openat64(a->at, a->path, a->flags, a->mode);
    }
}

#define OPEN_BODY(at_, which_) \
    mode_t mode = 0; \
    if (flags & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); } \
    struct open_args a = { at_, path, flags, mode, which_ }; \
    int fd = opening(at_, path, flags, do_open, &a); \
    return fd == -2 ? do_open(&a) : fd;

int open(const char *path, int flags, ...) { OPEN_BODY(AT_FDCWD, 0) }
int open64(const char *path, int flags, ...) { OPEN_BODY(AT_FDCWD, 1) }
int openat(int at, const char *path, int flags, ...) { OPEN_BODY(at, 2) }
int openat64(int at, const char *path, int flags, ...) { OPEN_BODY(at, 3) }

static void namespace_change(int kind, int at, const char *path) {
    char abs_path[PATH_MAX];
    if (undo_fd < 0 || !absolute(at, path, abs_path) || tracked_path(abs_path) != 1) return;
    pthread_mutex_lock(&lock);
    tick(C_NAMESPACE);
    const char *name = abs_path + dir_len + 1;
    struct rec r = {0};
    r.kind = (uint32_t)kind;
    r.cls = C_NAMESPACE;
    r.new_len = strlen(name);
    /* The length the name had, so the parent can put back a recovery
     * reserve whose removal no directory sync covered. */
    struct stat st;
    if (stat(abs_path, &st) == 0) r.old_size = (uint64_t)st.st_size;
    record(&r, NULL, name);
    pthread_mutex_unlock(&lock);
}

int unlink(const char *path) {
    namespace_change(K_UNLINK, AT_FDCWD, path);
    return real_unlink(path);
}
int unlinkat(int at, const char *path, int flags) {
    namespace_change(K_UNLINK, at, path);
    return real_unlinkat(at, path, flags);
}
int rename(const char *from, const char *to) {
    namespace_change(K_RENAME, AT_FDCWD, from);
    namespace_change(K_RENAME, AT_FDCWD, to);
    return real_rename(from, to);
}
int renameat(int a, const char *from, int b, const char *to) {
    namespace_change(K_RENAME, a, from);
    namespace_change(K_RENAME, b, to);
    return real_renameat(a, from, b, to);
}
