/* kvverify/_inject.so: tells a recording which of its child processes used CUDA.

   The CUDA driver loads the library named in the environment variable CUDA_INJECTION64_PATH into
   every process at cuInit, and calls its exported `int InitializeInjection(void)`: the injection
   entry point of NVIDIA's CUPTI samples and Nsight tools. A recording (kvverify/record/capture/
   processes.py) puts this library there and a folder of its own in KVVERIFY_CHILD_DIR; every
   process that inherits both and initializes CUDA leaves a marker in that folder, named by its pid:

       <pid>\n<ppid>\n<the command line, its arguments separated by NUL, as /proc/self/cmdline>

   written to a hidden name first and renamed, so that a reader never sees half a marker. Where
   KVVERIFY_INJECTION_NEXT names another tool's injection library (the one CUDA_INJECTION64_PATH
   held before the recording: Nsight Systems', compute-sanitizer's), that library is loaded and
   its InitializeInjection called too, so that the tool still sees the child.

   It runs inside every CUDA program the recording starts, before the program's first CUDA call
   returns: it must never crash it or change what it does. Every failure is silent (a marker not
   written is a child the recording does not name: nothing else), no descriptor stays open and errno
   is left as it was. Plain C, no CUDA headers: the driver asks for nothing but the symbol. */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

EXPORT int InitializeInjection(void);

/* Enough for a command line a user reads; a longer one is cut (the marker stays whole). */
enum { CMDLINE_MAX = 8192 };

static int write_all(int fd, const char *data, size_t n) {
    while (n > 0) {
        ssize_t done = write(fd, data, n);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0)
            return -1;
        data += done;
        n -= (size_t)done;
    }
    return 0;
}

static size_t read_cmdline(char *out, size_t size) {
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    size_t have = 0;
    while (have < size) {
        ssize_t got = read(fd, out + have, size - have);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        have += (size_t)got;
    }
    close(fd);
    return have;
}

static void write_marker(const char *folder) {
    char path[4096], hidden[4096], head[64], cmdline[CMDLINE_MAX];
    pid_t pid = getpid();
    int n = snprintf(path, sizeof path, "%s/%d", folder, (int)pid);
    int m = snprintf(hidden, sizeof hidden, "%s/.%d.part", folder, (int)pid);
    int h = snprintf(head, sizeof head, "%d\n%d\n", (int)pid, (int)getppid());
    if (n < 0 || m < 0 || h < 0 || (size_t)n >= sizeof path || (size_t)m >= sizeof hidden)
        return;  /* a folder name longer than a path can be: no marker */
    size_t length = read_cmdline(cmdline, sizeof cmdline);
    int fd = open(hidden, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return;  /* the recording is over and took its folder away, or it is not ours to write */
    int failed = write_all(fd, head, (size_t)h) || write_all(fd, cmdline, length);
    failed |= close(fd);
    if (failed || rename(hidden, path) != 0)
        unlink(hidden);
}

/* The library CUDA_INJECTION64_PATH named before the recording put this one there; never this one
   again (its InitializeInjection is this function: dlopen of a loaded library returns it). */
static void call_next(const char *next) {
    void *library = dlopen(next, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL)
        return;
    int (*initialize)(void) = (int (*)(void))dlsym(library, "InitializeInjection");
    if (initialize != NULL && initialize != InitializeInjection)
        initialize();
}

EXPORT int InitializeInjection(void) {
    int saved = errno;
    const char *folder = getenv("KVVERIFY_CHILD_DIR");
    if (folder != NULL && folder[0] != '\0')
        write_marker(folder);
    const char *next = getenv("KVVERIFY_INJECTION_NEXT");
    if (next != NULL && next[0] != '\0')
        call_next(next);
    errno = saved;
    return 1;
}
