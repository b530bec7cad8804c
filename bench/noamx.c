// Build: gcc -O2 -shared -fPIC -o /tmp/noamx.so bench/noamx.c -ldl; use: LD_PRELOAD=/tmp/noamx.so python bench/decode_vs_llama.py ...
// LD_PRELOAD shim: refuse arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) made through syscall(), so
// ggml's ggml_amx_init() fails and llama.cpp falls back to its CPU_REPACK buffers (q4_K_8x8) instead of the
// AMX path, whose tilezero raised SIGILL in this VM.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
long syscall(long n, ...) {
    static long (*real)(long, ...) = 0;
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    va_list ap; va_start(ap, n);
    long a[6]; for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (n == 158 && a[0] == 0x1023) { errno = EPERM; return -1; }
    return real(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}
