/* The file tier's batch I/O: many block files opened and read, looked at, or written and
 * published, in one call that releases the interpreter lock once, instead of system calls per
 * block that each give it up and take it back (under a scheduler thread that steps in Python,
 * every take-back waits for that thread).
 *
 * Policy stays in Python (kvtier/backends/file/reads.py and store.py): which directory and
 * name, which flags (O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, O_DIRECT, O_EXCL), what a result
 * means, how a frame is verified, what a failed store leaves to clean up. This module only makes
 * the system calls and reports each one's result; it keeps no state. Every descriptor a read
 * opens is handed back to the caller, who closes it with close_fds (so a bad frame's inode can
 * still be taken from it while it is judged).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_xxh3.h"

#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif

/* A result slot of a block the call was told to skip (a directory descriptor below 0), and of
 * a descriptor close_fds has closed: never an errno (those are -1..-4095) nor a descriptor. */
#define NOT_TAKEN (-(INT64_C(1) << 62))

static void
release_all(Py_buffer *views, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
    }
}

/* The arguments' shape, checked before anything is opened; -1 with an exception set. */
static int
check_shape(Py_ssize_t count, PyObject *names, PyObject *outs, Py_buffer *trailers,
            Py_ssize_t page, Py_buffer *results)
{
    if (PySequence_Fast_GET_SIZE(names) != count || PySequence_Fast_GET_SIZE(outs) != count) {
        PyErr_Format(PyExc_ValueError, "read_frames: %zd directory descriptors, %zd names and "
                     "%zd destinations; expected as many of each",
                     count, PySequence_Fast_GET_SIZE(names), PySequence_Fast_GET_SIZE(outs));
        return -1;
    }
    if (page <= 0 || trailers->len < count * page) {
        PyErr_Format(PyExc_ValueError, "read_frames: trailer buffer of %zd bytes for %zd pages "
                     "of %zd bytes; expected at least %zd", trailers->len, count, page,
                     count * page);
        return -1;
    }
    if (results->len < count * 2 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "read_frames: result buffer of %zd bytes for %zd blocks; "
                     "expected at least %zd", results->len, count,
                     count * 2 * (Py_ssize_t)sizeof(int64_t));
        return -1;
    }
    return 0;
}

/* Descriptors, names and writable views of one batch, taken with the lock held. */
static int
gather(Py_ssize_t count, PyObject *dir_fds, PyObject *names, PyObject *outs, int *dirs,
       const char **paths, Py_buffer *views, Py_ssize_t *taken)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(dir_fds, i));
        if (fd == -1 && PyErr_Occurred()) {
            return -1;
        }
        dirs[i] = (int)fd;
        PyObject *name = PySequence_Fast_GET_ITEM(names, i);
        if (!PyBytes_Check(name)) {
            PyErr_Format(PyExc_TypeError, "read_frames: name %zd is %.80s; expected bytes", i,
                         Py_TYPE(name)->tp_name);
            return -1;
        }
        paths[i] = PyBytes_AS_STRING(name);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(outs, i), &views[i],
                               PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS) < 0) {
            return -1;
        }
        *taken = i + 1;
    }
    return 0;
}

/* The trailer checksum, chosen once at load: the AVX2 build where the processor has it. */
typedef uint64_t (*xxh3_pair_fn)(const void *, size_t, const void *, size_t);
static xxh3_pair_fn xxh3_pair = kvtier_xxh3_pair;
static const char *xxh3_kernel = "baseline";

#define SEALED_RECORD_MAX 512
#define SEALED_NAME_MAX 255
#define SEALED_PREFIX_MAX 64
enum { SKIPPED = 4 };

/* A sealed record: what every unkeyed trailer of one key length and payload length shares (the
 * codec's template, key echo and checksum zero) and where the key and checksum go. */
typedef struct {
    const unsigned char *template;
    Py_ssize_t record_len, key_len, nbytes, key_offset, check_offset;
} SealSpec;

/* record = the template with key copied in at key_offset and, at check_offset, the
 * little-endian xxh3-64 of payload followed by record[0:check_offset] (FrameCodec's rule). */
static void
seal_record(unsigned char *record, const SealSpec *spec, const char *key, const void *payload,
            size_t payload_len)
{
    memcpy(record, spec->template, (size_t)spec->record_len);
    memcpy(record + spec->key_offset, key, (size_t)spec->key_len);
    uint64_t check = xxh3_pair(payload, payload_len, record, (size_t)spec->check_offset);
    for (int byte = 0; byte < 8; byte++) {
        record[spec->check_offset + byte] = (unsigned char)(check >> (8 * byte));
    }
}

/* The record layout a caller asked for, checked; -1 with an exception set. */
static int
check_seal_spec(const char *caller, const SealSpec *spec)
{
    if (spec->record_len > SEALED_RECORD_MAX || spec->check_offset < 0
        || spec->check_offset + 8 > spec->record_len || spec->key_offset < 0
        || spec->key_len < 1 || spec->key_offset + spec->key_len > spec->check_offset
        || spec->nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "%s: a record of %zd bytes with a key of %zd bytes at %zd "
                     "and its check at %zd; expected key and check inside a record of at most "
                     "%d bytes", caller, spec->record_len, spec->key_len, spec->key_offset,
                     spec->check_offset, SEALED_RECORD_MAX);
        return -1;
    }
    return 0;
}

/* Whether a block read whole (got bytes: payload, then its trailer in page) is exactly the
 * unkeyed frame spec describes for key: FrameCodec.is_current's rule. */
static int
is_sealed(const SealSpec *spec, const char *key, Py_ssize_t key_len, const Py_buffer *payload,
          const char *page, int64_t got)
{
    if (key_len != spec->key_len || payload->len != spec->nbytes
        || got != (int64_t)(payload->len + spec->record_len)) {
        return 0;
    }
    unsigned char expected[SEALED_RECORD_MAX];
    seal_record(expected, spec, key, payload->buf, (size_t)payload->len);
    return memcmp(expected, page, (size_t)spec->record_len) == 0;
}

/* The optional seal of read_frames: each block read whole checked against the template, with
 * its key, in the same pass (while the payload is still in cache). Taken with the lock held. */
typedef struct {
    SealSpec spec;
    Py_buffer template, verified;
    PyObject *keys;  /* a fast sequence of bytes, one per block (holds them alive) */
    const char **key_bytes;
    Py_ssize_t *key_lens;
    int active;
} ReadSeal;

static int
take_read_seal(PyObject *arg, Py_ssize_t count, ReadSeal *seal)
{
    PyObject *keys_arg;
    memset(seal, 0, sizeof(*seal));
    if (arg == Py_None) {
        return 0;
    }
    if (!PyArg_ParseTuple(arg, "Oy*nnnnw*:read_frames seal", &keys_arg, &seal->template,
                          &seal->spec.key_len, &seal->spec.nbytes, &seal->spec.key_offset,
                          &seal->spec.check_offset, &seal->verified)) {
        return -1;
    }
    seal->active = 1;
    seal->spec.template = seal->template.buf;
    seal->spec.record_len = seal->template.len;
    if (check_seal_spec("read_frames", &seal->spec) < 0) {
        return -1;
    }
    seal->keys = PySequence_Fast(keys_arg, "read_frames: seal keys must be a sequence");
    if (seal->keys == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seal->keys) != count || seal->verified.len < count) {
        PyErr_Format(PyExc_ValueError, "read_frames: %zd seal keys and %zd verdict bytes for %zd "
                     "blocks; expected one of each per block",
                     PySequence_Fast_GET_SIZE(seal->keys), seal->verified.len, count);
        return -1;
    }
    seal->key_bytes = PyMem_Calloc((size_t)count + 1, sizeof(char *));
    seal->key_lens = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
    if (seal->key_bytes == NULL || seal->key_lens == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seal->keys, i);
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "read_frames: seal key %zd is %.80s; expected bytes",
                         i, Py_TYPE(key)->tp_name);
            return -1;
        }
        seal->key_bytes[i] = PyBytes_AS_STRING(key);
        seal->key_lens[i] = PyBytes_GET_SIZE(key);
    }
    return 0;
}

static void
drop_read_seal(ReadSeal *seal)
{
    if (seal->active) {
        PyMem_Free(seal->key_lens);
        PyMem_Free(seal->key_bytes);
        Py_XDECREF(seal->keys);
        PyBuffer_Release(&seal->verified);
        PyBuffer_Release(&seal->template);
    }
}

/* The optional guard of a batch: the held namespace directory checked inside the call the way
 * TierDirs checks it before every batch (dirs.py), so that a batch makes one lock release, not
 * three: fstat of the held descriptor (mode, owner, mtime and ctime as last checked) and fstatat
 * of its name under the root without following a symlink (still the same device and inode).
 * (view_fd, root_fd, name, ino, dev, mode, uid, mtime_ns, ctime_ns), taken with the lock held. */
typedef struct {
    int active, view_fd, root_fd;
    const char *name;
    unsigned long long ino, dev, mode, uid;
    long long mtime_ns, ctime_ns;
} DirGuard;

enum { GUARD_REFUSED = -1 };
#define GUARD_FIELDS "view_fd, root_fd, name, ino, dev, mode, uid, mtime_ns, ctime_ns"

static int
take_guard(const char *caller, PyObject *arg, DirGuard *guard)
{
    PyObject *name;
    memset(guard, 0, sizeof(*guard));
    if (arg == Py_None) {
        return 0;
    }
    if (!PyTuple_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s: guard is %.80s; expected None or a tuple (%s)",
                     caller, Py_TYPE(arg)->tp_name, GUARD_FIELDS);
        return -1;
    }
    if (PyTuple_GET_SIZE(arg) != 9) {
        PyErr_Format(PyExc_ValueError, "%s: guard of %zd items; expected 9 (%s)", caller,
                     PyTuple_GET_SIZE(arg), GUARD_FIELDS);
        return -1;
    }
    if (!PyArg_ParseTuple(arg, "iiSKKKKLL", &guard->view_fd, &guard->root_fd, &name,
                          &guard->ino, &guard->dev, &guard->mode, &guard->uid, &guard->mtime_ns,
                          &guard->ctime_ns)) {
        return -1;
    }
    guard->name = PyBytes_AS_STRING(name);  /* held alive by the argument tuple */
    guard->active = 1;
    return 0;
}

static long long
stamp_ns(struct timespec stamp)
{
    return (long long)stamp.tv_sec * 1000000000LL + (long long)stamp.tv_nsec;
}

/* Whether the guarded directory is as last checked (1 with no guard); called without the lock.
 * Any error reads as "not as checked": the caller's careful path looks again and reports. */
static int
guard_holds(const DirGuard *guard)
{
    struct stat held, named;
    if (!guard->active) {
        return 1;
    }
    if (fstat(guard->view_fd, &held) < 0
        || fstatat(guard->root_fd, guard->name, &named, AT_SYMLINK_NOFOLLOW) < 0) {
        return 0;
    }
    return (unsigned long long)named.st_ino == guard->ino
        && (unsigned long long)named.st_dev == guard->dev
        && (unsigned long long)held.st_mode == guard->mode
        && (unsigned long long)held.st_uid == guard->uid
        && stamp_ns(held.st_mtim) == guard->mtime_ns && stamp_ns(held.st_ctim) == guard->ctime_ns;
}

/* read_frames(dir_fds, names, outs, trailers, page, results, flags[, seal[, guard]])
 *
 * For each i: openat(dir_fds[i], names[i], flags | O_CLOEXEC), then one preadv at offset 0 into
 * [outs[i], trailers[i * page : (i + 1) * page]]. results (int64, 2 per block) gets the
 * descriptor or -errno of the open, then the byte count or -errno of the read (0 where the open
 * failed); a block whose dir_fds[i] is below 0 is skipped (NOT_TAKEN, 0). Every slot is
 * written. System calls interrupted by a signal are retried.
 *
 * seal, where given, is (keys, template, key_len, nbytes, key_offset, check_offset, verified):
 * verified[i] becomes 1 where block i was read whole (payload and exactly the template's length
 * of trailer) and its trailer is exactly store_sealed's for keys[i] over what was read (magic,
 * version, lengths, namespace, key echo, algorithm and the xxh3 check: FrameCodec.is_current's
 * rule), else 0, for the caller's own verification; the descriptor of a block found exact is
 * closed in the call (its slot NOT_TAKEN): it has nothing left to judge.
 *
 * guard, where given, is checked first (DirGuard); where it does not hold nothing is opened,
 * every slot is NOT_TAKEN and the call returns GUARD_REFUSED. Otherwise it returns the number of
 * descriptors left open for the caller (0: no close_fds call needed). */
static PyObject *
read_frames(PyObject *module, PyObject *args)
{
    PyObject *dir_fds_arg, *names_arg, *outs_arg, *seal_arg = Py_None, *guard_arg = Py_None;
    Py_buffer trailers, results;
    Py_ssize_t page, left = 0;
    int flags, refused = 0;
    ReadSeal seal;
    DirGuard guard;
    (void)module;
    memset(&seal, 0, sizeof(seal));
    if (!PyArg_ParseTuple(args, "OOOw*nw*i|OO:read_frames", &dir_fds_arg, &names_arg, &outs_arg,
                          &trailers, &page, &results, &flags, &seal_arg, &guard_arg)) {
        return NULL;
    }
    PyObject *dir_fds = NULL, *names = NULL, *outs = NULL, *answer = NULL;
    int *dirs = NULL;
    const char **paths = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t taken = 0, count = 0;
    dir_fds = PySequence_Fast(dir_fds_arg, "read_frames: dir_fds must be a sequence");
    names = dir_fds ? PySequence_Fast(names_arg, "read_frames: names must be a sequence") : NULL;
    outs = names ? PySequence_Fast(outs_arg, "read_frames: outs must be a sequence") : NULL;
    if (outs == NULL) {
        goto done;
    }
    count = PySequence_Fast_GET_SIZE(dir_fds);
    if (check_shape(count, names, outs, &trailers, page, &results) < 0) {
        goto done;
    }
    dirs = PyMem_Calloc((size_t)count + 1, sizeof(int));
    paths = PyMem_Calloc((size_t)count + 1, sizeof(char *));
    views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    if (dirs == NULL || paths == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (gather(count, dir_fds, names, outs, dirs, paths, views, &taken) < 0
        || take_read_seal(seal_arg, count, &seal) < 0
        || take_guard("read_frames", guard_arg, &guard) < 0) {
        goto done;
    }
    unsigned char *verified = seal.active ? (unsigned char *)seal.verified.buf : NULL;
    if (verified != NULL) {
        memset(verified, 0, (size_t)count);
    }
    int64_t *out = (int64_t *)results.buf;
    char *pages = (char *)trailers.buf;
    Py_BEGIN_ALLOW_THREADS
    refused = !guard_holds(&guard);
    for (Py_ssize_t i = 0; i < count; i++) {
        int fd;
        if (dirs[i] < 0 || refused) {
            out[2 * i] = NOT_TAKEN;
            out[2 * i + 1] = 0;
            continue;
        }
        do {
            fd = openat(dirs[i], paths[i], flags | O_CLOEXEC);
        } while (fd < 0 && errno == EINTR);
        if (fd < 0) {
            out[2 * i] = -(int64_t)errno;
            out[2 * i + 1] = 0;
            continue;
        }
        struct iovec parts[2] = {
            {views[i].buf, (size_t)views[i].len},
            {pages + i * page, (size_t)page},
        };
        ssize_t got;
        do {
            got = preadv(fd, parts, 2, 0);
        } while (got < 0 && errno == EINTR);
        out[2 * i] = fd;
        out[2 * i + 1] = got < 0 ? -(int64_t)errno : (int64_t)got;
        if (verified != NULL && got > 0) {
            verified[i] = (unsigned char)is_sealed(&seal.spec, seal.key_bytes[i],
                                                   seal.key_lens[i], &views[i], pages + i * page,
                                                   (int64_t)got);
        }
        if (verified != NULL && verified[i]) {
            close(fd);  /* Linux frees the descriptor even on EINTR: no retry */
            out[2 * i] = NOT_TAKEN;
        } else {
            left++;
        }
    }
    Py_END_ALLOW_THREADS
    answer = PyLong_FromSsize_t(refused ? GUARD_REFUSED : left);
done:
    drop_read_seal(&seal);
    release_all(views, taken);
    PyMem_Free(views);
    PyMem_Free(paths);
    PyMem_Free(dirs);
    Py_XDECREF(outs);
    Py_XDECREF(names);
    Py_XDECREF(dir_fds);
    PyBuffer_Release(&results);
    PyBuffer_Release(&trailers);
    return answer;
}

/* close_fds(results, count): close every descriptor read_frames reported (entries 2 * i that
 * are >= 0), then mark it NOT_TAKEN so that a second call closes nothing twice. */
static PyObject *
close_fds(PyObject *module, PyObject *args)
{
    Py_buffer results;
    Py_ssize_t count;
    (void)module;
    if (!PyArg_ParseTuple(args, "w*n:close_fds", &results, &count)) {
        return NULL;
    }
    if (count < 0 || results.len < count * 2 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "close_fds: %zd blocks in a result buffer of %zd bytes",
                     count, results.len);
        PyBuffer_Release(&results);
        return NULL;
    }
    int64_t *out = (int64_t *)results.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        if (out[2 * i] >= 0) {
            close((int)out[2 * i]);  /* Linux frees the descriptor even on EINTR: no retry */
            out[2 * i] = NOT_TAKEN;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&results);
    Py_RETURN_NONE;
}

/* stat_names(dir_fds, names, results[, guard]): for each i, fstatat(dir_fds[i], names[i])
 * without following a symlink; results (int64, 1 per name) gets st_mode, or -errno, or NOT_TAKEN
 * where dir_fds[i] is below 0. guard as read_frames': where it does not hold nothing is looked
 * at, every slot is NOT_TAKEN and the call returns False; else True. */
static PyObject *
stat_names(PyObject *module, PyObject *args)
{
    PyObject *dir_fds_arg, *names_arg, *guard_arg = Py_None;
    Py_buffer results;
    DirGuard guard;
    int refused = 0;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOw*|O:stat_names", &dir_fds_arg, &names_arg, &results,
                          &guard_arg)) {
        return NULL;
    }
    PyObject *dir_fds = NULL, *names = NULL, *answer = NULL;
    int *dirs = NULL;
    const char **paths = NULL;
    Py_ssize_t count = 0;
    dir_fds = PySequence_Fast(dir_fds_arg, "stat_names: dir_fds must be a sequence");
    names = dir_fds ? PySequence_Fast(names_arg, "stat_names: names must be a sequence") : NULL;
    if (names == NULL) {
        goto done;
    }
    count = PySequence_Fast_GET_SIZE(dir_fds);
    if (PySequence_Fast_GET_SIZE(names) != count
            || results.len < count * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "stat_names: %zd directory descriptors, %zd names and "
                     "a result buffer of %zd bytes; expected as many names and 8 bytes each",
                     count, PySequence_Fast_GET_SIZE(names), results.len);
        goto done;
    }
    dirs = PyMem_Calloc((size_t)count + 1, sizeof(int));
    paths = PyMem_Calloc((size_t)count + 1, sizeof(char *));
    if (dirs == NULL || paths == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(dir_fds, i));
        if (fd == -1 && PyErr_Occurred()) {
            goto done;
        }
        dirs[i] = (int)fd;
        PyObject *name = PySequence_Fast_GET_ITEM(names, i);
        if (!PyBytes_Check(name)) {
            PyErr_Format(PyExc_TypeError, "stat_names: name %zd is %.80s; expected bytes", i,
                         Py_TYPE(name)->tp_name);
            goto done;
        }
        paths[i] = PyBytes_AS_STRING(name);
    }
    if (take_guard("stat_names", guard_arg, &guard) < 0) {
        goto done;
    }
    int64_t *out = (int64_t *)results.buf;
    Py_BEGIN_ALLOW_THREADS
    refused = !guard_holds(&guard);
    for (Py_ssize_t i = 0; i < count; i++) {
        struct stat info;
        int rc;
        if (dirs[i] < 0 || refused) {
            out[i] = NOT_TAKEN;
            continue;
        }
        do {
            rc = fstatat(dirs[i], paths[i], &info, AT_SYMLINK_NOFOLLOW);
        } while (rc < 0 && errno == EINTR);
        out[i] = rc < 0 ? -(int64_t)errno : (int64_t)info.st_mode;
    }
    Py_END_ALLOW_THREADS
    answer = PyBool_FromLong(!refused);
done:
    PyMem_Free(paths);
    PyMem_Free(dirs);
    Py_XDECREF(names);
    Py_XDECREF(dir_fds);
    PyBuffer_Release(&results);
    return answer;
}

enum { STORED = 0, OPEN_FAILED = 1, WRITE_FAILED = 2, RENAME_FAILED = 3 };
#define KVTIER_RENAME_NOREPLACE 1

/* Write all of parts to fd (a regular file rarely writes short, but may); 0 or -errno. */
static int
write_all(int fd, struct iovec *parts, int count)
{
    while (count > 0) {
        ssize_t done = writev(fd, parts, count);
        if (done < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        if (done == 0) {
            return -EIO;
        }
        while (count > 0 && (size_t)done >= parts->iov_len) {
            done -= (ssize_t)parts->iov_len;
            parts++;
            count--;
        }
        if (count > 0) {
            parts->iov_base = (char *)parts->iov_base + done;
            parts->iov_len -= (size_t)done;
        }
    }
    return 0;
}

/* One frame: create temps under fan, write payload then trailer, close, rename to final
 * without replacing. Stage and errno into out[0], out[1]. */
static void
write_one(int fan, const char *temp, const char *final, const void *payload, size_t payload_len,
          const void *trailer, size_t trailer_len, int flags, int mode, Py_ssize_t length,
          int64_t *out)
{
    int fd;
    do {
        fd = openat(fan, temp, flags | O_CLOEXEC, mode);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        out[0] = OPEN_FAILED;
        out[1] = errno;
        return;
    }
    struct iovec parts[2] = {
        {(void *)payload, payload_len},
        {(void *)trailer, trailer_len},
    };
    int written = write_all(fd, parts, 2);
    if (written == 0 && length >= 0 && ftruncate(fd, (off_t)length) != 0) {
        written = -errno;  /* O_DIRECT: whole pages written, cut to the frame's size */
    }
    int closed = close(fd);
    if (written < 0 || (closed < 0 && errno != EINTR)) {
        out[0] = WRITE_FAILED;
        out[1] = written < 0 ? -written : errno;
        return;
    }
    if (syscall(SYS_renameat2, fan, temp, fan, final, KVTIER_RENAME_NOREPLACE) != 0) {
        out[0] = RENAME_FAILED;
        out[1] = errno;
        return;
    }
    out[0] = STORED;
    out[1] = 0;
}

/* write_frames(fan_fds, temps, finals, payloads, trailers, results, flags, mode[, lengths])
 *
 * For each i, under fan_fds[i]: openat(temps[i], flags | O_CLOEXEC, mode), write payloads[i]
 * then trailers[i], cut the file to lengths[i] where lengths is given (O_DIRECT writes whole
 * pages), close, renameat2(temps[i], finals[i], RENAME_NOREPLACE). results (int64, 2 per
 * frame) gets the stage that failed (0 stored, 1 open, 2 write, cut or close, 3 rename) and its
 * errno. A temp file whose write or rename failed is left for the caller to remove. */
static PyObject *
write_frames(PyObject *module, PyObject *args)
{
    PyObject *fans_arg, *temps_arg, *finals_arg, *payloads_arg, *trailers_arg;
    PyObject *lengths_arg = Py_None;
    Py_buffer results;
    int flags, mode;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOOOw*ii|O:write_frames", &fans_arg, &temps_arg, &finals_arg,
                          &payloads_arg, &trailers_arg, &results, &flags, &mode,
                          &lengths_arg)) {
        return NULL;
    }
    PyObject *seqs[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *args_in[5] = {fans_arg, temps_arg, finals_arg, payloads_arg, trailers_arg};
    PyObject *lengths_seq = NULL;
    Py_ssize_t *lengths = NULL;
    PyObject *answer = NULL;
    int *fans = NULL;
    const char **temps = NULL, **finals = NULL;
    Py_buffer *views = NULL;  /* payload i at 2i, trailer i at 2i + 1 */
    Py_ssize_t taken = 0, count = 0;
    for (int k = 0; k < 5; k++) {
        seqs[k] = PySequence_Fast(args_in[k], "write_frames: arguments must be sequences");
        if (seqs[k] == NULL) {
            goto done;
        }
    }
    count = PySequence_Fast_GET_SIZE(seqs[0]);
    for (int k = 1; k < 5; k++) {
        if (PySequence_Fast_GET_SIZE(seqs[k]) != count) {
            PyErr_Format(PyExc_ValueError, "write_frames: argument %d has %zd items, the first "
                         "%zd; expected as many of each", k + 1,
                         PySequence_Fast_GET_SIZE(seqs[k]), count);
            goto done;
        }
    }
    if (results.len < count * 2 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "write_frames: result buffer of %zd bytes for %zd "
                     "frames", results.len, count);
        goto done;
    }
    fans = PyMem_Calloc((size_t)count + 1, sizeof(int));
    temps = PyMem_Calloc((size_t)count + 1, sizeof(char *));
    finals = PyMem_Calloc((size_t)count + 1, sizeof(char *));
    views = PyMem_Calloc(2 * (size_t)count + 1, sizeof(Py_buffer));
    lengths = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
    if (fans == NULL || temps == NULL || finals == NULL || views == NULL || lengths == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (lengths_arg != Py_None) {
        lengths_seq = PySequence_Fast(lengths_arg, "write_frames: lengths must be a sequence");
        if (lengths_seq == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(lengths_seq) != count) {
            PyErr_Format(PyExc_ValueError, "write_frames: %zd lengths for %zd frames",
                         PySequence_Fast_GET_SIZE(lengths_seq), count);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        lengths[i] = -1;
        if (lengths_seq != NULL) {
            lengths[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(lengths_seq, i));
            if (lengths[i] < 0) {
                if (!PyErr_Occurred()) {
                    PyErr_Format(PyExc_ValueError, "write_frames: length %zd is negative", i);
                }
                goto done;
            }
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seqs[0], i));
        if (fd == -1 && PyErr_Occurred()) {
            goto done;
        }
        fans[i] = (int)fd;
        PyObject *temp = PySequence_Fast_GET_ITEM(seqs[1], i);
        PyObject *final = PySequence_Fast_GET_ITEM(seqs[2], i);
        if (!PyBytes_Check(temp) || !PyBytes_Check(final)) {
            PyErr_Format(PyExc_TypeError, "write_frames: names of frame %zd must be bytes", i);
            goto done;
        }
        temps[i] = PyBytes_AS_STRING(temp);
        finals[i] = PyBytes_AS_STRING(final);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seqs[3], i), &views[2 * i],
                               PyBUF_ANY_CONTIGUOUS) < 0) {
            goto done;
        }
        taken = 2 * i + 1;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seqs[4], i), &views[2 * i + 1],
                               PyBUF_ANY_CONTIGUOUS) < 0) {
            goto done;
        }
        taken = 2 * i + 2;
    }
    int64_t *out = (int64_t *)results.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        write_one(fans[i], temps[i], finals[i], views[2 * i].buf, (size_t)views[2 * i].len,
                  views[2 * i + 1].buf, (size_t)views[2 * i + 1].len, flags, mode, lengths[i],
                  out + 2 * i);
    }
    Py_END_ALLOW_THREADS
    answer = Py_NewRef(Py_None);
done:
    release_all(views, taken);
    Py_XDECREF(lengths_seq);
    PyMem_Free(lengths);
    PyMem_Free(views);
    PyMem_Free(finals);
    PyMem_Free(temps);
    PyMem_Free(fans);
    for (int k = 0; k < 5; k++) {
        Py_XDECREF(seqs[k]);
    }
    PyBuffer_Release(&results);
    return answer;
}


/* A sealed store's arguments, taken with the lock held: key bytes and lengths, payload views,
 * temp numbers. -1 with an exception set. */
static int
gather_sealed(Py_ssize_t count, PyObject *keys, PyObject *payloads, PyObject *numbers,
              const char **key_bytes, Py_ssize_t *key_lens, Py_buffer *views,
              long long *temp_numbers, Py_ssize_t *taken)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "store_sealed: key %zd is %.80s; expected bytes", i,
                         Py_TYPE(key)->tp_name);
            return -1;
        }
        key_bytes[i] = PyBytes_AS_STRING(key);
        key_lens[i] = PyBytes_GET_SIZE(key);
        temp_numbers[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(numbers, i));
        if (temp_numbers[i] < 0) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "store_sealed: temp number %zd is negative", i);
            }
            return -1;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(payloads, i), &views[i],
                               PyBUF_ANY_CONTIGUOUS) < 0) {
            return -1;
        }
        *taken = i + 1;
    }
    return 0;
}

/* O_DIRECT's unit here: layout.py's _ALIGN (exported as DIRECT_ALIGN, checked by the tests). */
#define DIRECT_ALIGN 4096

/* Whether O_DIRECT can write payload where it is: whole pages at an aligned address. */
static int
whole_pages(const Py_buffer *payload)
{
    return payload->len > 0 && payload->len % DIRECT_ALIGN == 0
        && (uintptr_t)payload->buf % DIRECT_ALIGN == 0;
}

/* One sealed block: its record filled in and checksummed, its names built, then write_one. */
static void
seal_one(const int32_t *fan_table, const char *key, Py_ssize_t key_len, const Py_buffer *payload,
         long long number, const SealSpec *spec, const Py_buffer *prefix,
         const Py_buffer *suffix, int flags, int mode, unsigned char *direct_page,
         int64_t *out)
{
    static const char digits[] = "0123456789abcdef";
    int fan = fan_table[(unsigned char)key[0]];
    if (key_len != spec->key_len || payload->len != spec->nbytes || fan < 0
        || (direct_page != NULL && !whole_pages(payload))) {
        out[0] = SKIPPED;
        out[1] = 0;
        return;
    }
    unsigned char record[SEALED_RECORD_MAX];
    /* O_DIRECT: the trailer goes out from its own zeroed aligned page, written whole, and the
     * file is cut to the frame's size afterwards (as write_frames' lengths do). */
    unsigned char *trailer = direct_page != NULL ? direct_page : record;
    seal_record(trailer, spec, key, payload->buf, (size_t)payload->len);
    char final[SEALED_NAME_MAX + 1];
    for (Py_ssize_t i = 0; i < key_len; i++) {
        final[2 * i] = digits[(unsigned char)key[i] >> 4];
        final[2 * i + 1] = digits[(unsigned char)key[i] & 15];
    }
    memcpy(final + 2 * key_len, suffix->buf, (size_t)suffix->len);
    final[2 * key_len + suffix->len] = '\0';
    char temp[SEALED_PREFIX_MAX + 24];
    memcpy(temp, prefix->buf, (size_t)prefix->len);
    snprintf(temp + prefix->len, 24, "%lld", number);
    write_one(fan, temp, final, payload->buf, (size_t)payload->len, trailer,
              direct_page != NULL ? DIRECT_ALIGN : (size_t)spec->record_len, flags, mode,
              direct_page != NULL ? payload->len + spec->record_len : -1, out);
}

/* store_sealed(fan_table, keys, payloads, numbers, template, key_len, nbytes, key_offset,
 *              check_offset, temp_prefix, suffix, results, flags, mode)
 *
 * write_frames for blocks whose trailers are sealed here rather than in Python. For each i the
 * trailer is template with keys[i] copied in at key_offset and, at check_offset, the
 * little-endian xxh3-64 of payloads[i] followed by the trailer's first check_offset bytes. The
 * block is written under fan_table[keys[i][0]] (256 int32: the cached fan-out directory
 * descriptors, -1 where none) as temp_prefix + numbers[i] in decimal, and published as the hex
 * of keys[i] + suffix. A block whose key is not key_len bytes, whose payload is not nbytes, or
 * whose fan-out directory is not cached is skipped (stage 4, for the caller's other paths), and
 * with O_DIRECT in flags so is a payload that is not whole pages at an aligned address (the
 * trailer then goes out from a zeroed page of its own and the file is cut to the frame).
 * Stages otherwise as write_frames; a temp file whose write or rename failed is left for the
 * caller to remove. guard as read_frames': where it does not hold nothing is written, every
 * block is skipped and the call returns False; else True. */
static PyObject *
store_sealed(PyObject *module, PyObject *args)
{
    Py_buffer fan_table, template, prefix, suffix, results;
    PyObject *keys_arg, *payloads_arg, *numbers_arg, *guard_arg = Py_None;
    Py_ssize_t key_len, nbytes, key_offset, check_offset;
    int flags, mode, refused = 0;
    DirGuard guard;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*OOOy*nnnny*y*w*ii|O:store_sealed", &fan_table, &keys_arg,
                          &payloads_arg, &numbers_arg, &template, &key_len, &nbytes, &key_offset,
                          &check_offset, &prefix, &suffix, &results, &flags, &mode, &guard_arg)) {
        return NULL;
    }
    PyObject *keys = NULL, *payloads = NULL, *numbers = NULL, *answer = NULL;
    const char **key_bytes = NULL;
    Py_ssize_t *key_lens = NULL;
    Py_buffer *views = NULL;
    long long *temp_numbers = NULL;
    unsigned char *direct_page = NULL;
    Py_ssize_t count = 0, taken = 0;
    if (fan_table.len != 256 * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_Format(PyExc_ValueError, "store_sealed: fan table of %zd bytes; expected 256 "
                     "int32", fan_table.len);
        goto done;
    }
    SealSpec spec = {template.buf, template.len, key_len, nbytes, key_offset, check_offset};
    if (check_seal_spec("store_sealed", &spec) < 0) {
        goto done;
    }
    if (2 * key_len + suffix.len > SEALED_NAME_MAX || prefix.len > SEALED_PREFIX_MAX) {
        PyErr_Format(PyExc_ValueError, "store_sealed: names of %zd hex digits + %zd and a temp "
                     "prefix of %zd bytes; expected at most %d and %d", 2 * key_len, suffix.len,
                     prefix.len, SEALED_NAME_MAX, SEALED_PREFIX_MAX);
        goto done;
    }
    keys = PySequence_Fast(keys_arg, "store_sealed: keys must be a sequence");
    payloads = PySequence_Fast(payloads_arg, "store_sealed: payloads must be a sequence");
    numbers = PySequence_Fast(numbers_arg, "store_sealed: numbers must be a sequence");
    if (keys == NULL || payloads == NULL || numbers == NULL) {
        goto done;
    }
    count = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(payloads) != count || PySequence_Fast_GET_SIZE(numbers) != count) {
        PyErr_Format(PyExc_ValueError, "store_sealed: %zd keys, %zd payloads and %zd temp "
                     "numbers; expected as many of each", count,
                     PySequence_Fast_GET_SIZE(payloads), PySequence_Fast_GET_SIZE(numbers));
        goto done;
    }
    if (results.len < count * 2 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "store_sealed: result buffer of %zd bytes for %zd blocks",
                     results.len, count);
        goto done;
    }
    key_bytes = PyMem_Calloc((size_t)count + 1, sizeof(char *));
    key_lens = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
    views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    temp_numbers = PyMem_Calloc((size_t)count + 1, sizeof(long long));
    if (key_bytes == NULL || key_lens == NULL || views == NULL || temp_numbers == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (gather_sealed(count, keys, payloads, numbers, key_bytes, key_lens, views, temp_numbers,
                      &taken) < 0
        || take_guard("store_sealed", guard_arg, &guard) < 0) {
        goto done;
    }
#ifdef O_DIRECT
    if ((flags & O_DIRECT) != 0) {
        if (posix_memalign((void **)&direct_page, DIRECT_ALIGN, DIRECT_ALIGN) != 0) {
            direct_page = NULL;
            PyErr_NoMemory();
            goto done;
        }
        memset(direct_page, 0, DIRECT_ALIGN);
    }
#endif
    const int32_t *fans = (const int32_t *)fan_table.buf;
    int64_t *out = (int64_t *)results.buf;
    Py_BEGIN_ALLOW_THREADS
    refused = !guard_holds(&guard);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (refused) {
            out[2 * i] = SKIPPED;
            out[2 * i + 1] = 0;
            continue;
        }
        seal_one(fans, key_bytes[i], key_lens[i], &views[i], temp_numbers[i], &spec, &prefix,
                 &suffix, flags, mode, direct_page, out + 2 * i);
    }
    Py_END_ALLOW_THREADS
    answer = PyBool_FromLong(!refused);
done:
    free(direct_page);
    release_all(views, taken);
    PyMem_Free(temp_numbers);
    PyMem_Free(views);
    PyMem_Free(key_lens);
    PyMem_Free(key_bytes);
    Py_XDECREF(numbers);
    Py_XDECREF(payloads);
    Py_XDECREF(keys);
    PyBuffer_Release(&results);
    PyBuffer_Release(&suffix);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&template);
    PyBuffer_Release(&fan_table);
    return answer;
}

/* xxh3_pair(first, second): the checksum store_sealed writes (for tests and diagnostics). */
static PyObject *
xxh3_pair_of(PyObject *module, PyObject *args)
{
    Py_buffer first, second;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*y*:xxh3_pair", &first, &second)) {
        return NULL;
    }
    uint64_t check = xxh3_pair(first.buf, (size_t)first.len, second.buf, (size_t)second.len);
    PyBuffer_Release(&second);
    PyBuffer_Release(&first);
    return PyLong_FromUnsignedLongLong((unsigned long long)check);
}

static PyMethodDef methods[] = {
    {"read_frames", read_frames, METH_VARARGS,
     "read_frames(dir_fds, names, outs, trailers, page, results, flags[, seal[, guard]]): open "
     "and read many block files with the interpreter lock released once (with seal, check each "
     "unkeyed trailer in the same pass; with guard, check the namespace directory first); the "
     "number of descriptors left open, or GUARD_REFUSED."},
    {"close_fds", close_fds, METH_VARARGS,
     "close_fds(results, count): close the descriptors read_frames reported."},
    {"write_frames", write_frames, METH_VARARGS,
     "write_frames(fan_fds, temps, finals, payloads, trailers, results, flags, mode[, lengths]): "
     "write and publish many frames with the interpreter lock released once."},
    {"store_sealed", store_sealed, METH_VARARGS,
     "store_sealed(fan_table, keys, payloads, numbers, template, key_len, nbytes, key_offset, "
     "check_offset, temp_prefix, suffix, results, flags, mode[, guard]): write_frames with "
     "each trailer sealed (key echo and xxh3 checksum) in the same call; False where the guard "
     "refused."},
    {"xxh3_pair", xxh3_pair_of, METH_VARARGS,
     "xxh3_pair(first, second): the xxh3-64 of first then second, as store_sealed seals."},
    {"stat_names", stat_names, METH_VARARGS,
     "stat_names(dir_fds, names, results[, guard]): the st_mode (or -errno) of many names, "
     "without following symlinks, with the interpreter lock released once; False where the "
     "guard refused."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_batchio",
    "Batch reads and stats of block files without the interpreter lock (see reads.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__batchio(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
#if KVTIER_XXH3_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        xxh3_pair = kvtier_xxh3_pair_avx2;
        xxh3_kernel = "avx2";
    }
#endif
    if (PyModule_AddStringConstant(module, "XXH3_KERNEL", xxh3_kernel) < 0
            || PyModule_AddIntConstant(module, "SKIPPED", SKIPPED) < 0
            || PyModule_AddIntConstant(module, "GUARD_REFUSED", GUARD_REFUSED) < 0
            || PyModule_AddIntConstant(module, "DIRECT_ALIGN", DIRECT_ALIGN) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    PyObject *not_taken = PyLong_FromLongLong((long long)NOT_TAKEN);
    if (not_taken == NULL || PyModule_AddObject(module, "NOT_TAKEN", not_taken) < 0) {
        Py_XDECREF(not_taken);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
