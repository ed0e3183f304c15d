/*
 * hicache_file._fastio: the syscalls that move one page (publish: O_TMPFILE, writev, linkat,
 * close; read: open, readv, close). Called by the batch runners in _fastio.c, on any thread,
 * without the GIL.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "_fastio.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* Consume `n` transferred bytes from iov[0..*cnt): drop the buffers filled, shorten the next. */
static struct iovec *iov_advance(struct iovec *iov, int *cnt, size_t n) {
    while (*cnt > 0 && n >= iov->iov_len) {
        n -= iov->iov_len;
        iov++;
        (*cnt)--;
    }
    if (*cnt > 0) {
        iov->iov_base = (char *)iov->iov_base + n;
        iov->iov_len -= n;
    }
    return iov;
}

/* Write every byte of iov[0..cnt) to fd (the array is consumed). 0 or -errno. */
static long write_all(int fd, struct iovec *iov, int cnt) {
    while (cnt > 0) {
        ssize_t n = writev(fd, iov, cnt > IOV_MAX ? IOV_MAX : cnt);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) return -EIO;
        iov = iov_advance(iov, &cnt, (size_t)n);
    }
    return 0;
}

#ifdef O_TMPFILE
/* Whether linkat(fd, "", ..., AT_EMPTY_PATH) works for this process: it needs
 * CAP_DAC_READ_SEARCH (ENOENT without it). 1 yes, 0 no, -1 not known yet. A benign race: every
 * thread that sees -1 probes, and all of them store the same answer. */
static volatile int empty_path_ok = -1;

/* Give the unnamed inode behind fd the name path. 0 linked, 1 path exists (EEXIST), -errno. */
static long link_fd(int fd, const char *path) {
#ifdef AT_EMPTY_PATH
    if (empty_path_ok != 0) {
        if (linkat(fd, "", AT_FDCWD, path, AT_EMPTY_PATH) == 0) {
            empty_path_ok = 1;
            return 0;
        }
        if (errno == EEXIST) return 1;
        if (errno != ENOENT && errno != EPERM) return -errno;
        /* ENOENT/EPERM: no capability, or the shard directory is gone; /proc tells which. */
    }
#endif
    char proc[64];
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
    if (linkat(AT_FDCWD, proc, AT_FDCWD, path, AT_SYMLINK_FOLLOW) != 0) return errno == EEXIST ? 1 : -errno;
    if (empty_path_ok == -1) empty_path_ok = 0; /* /proc worked where AT_EMPTY_PATH did not */
    return 0;
}
#endif

#ifdef O_TMPFILE
/* An unnamed O_TMPFILE inode in directory dir: the fd, or -errno. */
static int open_tmpfile(const char *dir) {
    int fd;
    do {
        fd = open(dir, O_WRONLY | O_TMPFILE | O_CLOEXEC, 0644);
    } while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : fd;
}
#endif

/* Publish one item whose existence was already checked (see hc_item_exists). */
long hc_publish_one(Item *it, struct iovec *iov) {
#ifdef O_TMPFILE
    int fd = open_tmpfile(it->dir);
    if (fd == -ENOENT) {
        /* A new shard directory: create it here, and its parent (the namespace directory) on a
         * namespace's first page; the root always exists. Anything else still missing goes back
         * to Python as -ENOENT, which creates the whole path. A racing writer creating either
         * too is fine (EEXIST). */
        size_t len = strlen(it->dir);
        char shard[PATH_MAX];
        if (len > 0 && len < sizeof(shard)) {
            memcpy(shard, it->dir, len + 1);
            if (shard[len - 1] == '/') shard[len - 1] = '\0';
            int made = mkdir(shard, 0777) == 0 || errno == EEXIST;
            char *slash = made ? NULL : strrchr(shard, '/');
            if (!made && errno == ENOENT && slash != NULL && slash != shard) {
                *slash = '\0';
                int parent = mkdir(shard, 0777) == 0 || errno == EEXIST;
                *slash = '/';
                made = parent && (mkdir(shard, 0777) == 0 || errno == EEXIST);
            }
            if (made) fd = open_tmpfile(it->dir);
        }
    }
    if (fd < 0) return fd;
    long rc = write_all(fd, iov, (int)it->count);
    if (rc == 0) rc = link_fd(fd, it->path);
    close(fd);
    return rc;
#else
    (void)it;
    (void)iov;
    return -ENOSYS;
#endif
}

/* The item asks to skip a present page, and its path exists. */
int hc_item_exists(const Item *it) { return it->check_exists && access(it->path, F_OK) == 0; }

long hc_read_one(Item *it, struct iovec *iov) {
    int fd;
    do {
        fd = open(it->path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return -errno;
    long total = 0;
    int cnt = (int)it->count;
    while (cnt > 1 || (cnt == 1 && it->count == 1)) { /* stop when only the probe is left */
        ssize_t n = readv(fd, iov, cnt > IOV_MAX ? IOV_MAX : cnt);
        if (n < 0) {
            if (errno == EINTR) continue;
            total = -errno;
            break;
        }
        if (n == 0) break; /* EOF: the caller compares the count with what it expected */
        total += (long)n;
        iov = iov_advance(iov, &cnt, (size_t)n);
    }
    close(fd);
    return total;
}

