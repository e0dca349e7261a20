// The glibc symbols newer than manylinux_2_28 (glibc 2.28) that a build on a newer Linux would
// make _C import, redirected to what glibc 2.28 has, so that a wheel built on a newer glibc
// installs on glibc 2.28 and later (scripts/build_wheel.sh checks it with auditwheel;
// tests/test_build_check.py names any newer version _C still needs).
//
// Where they come from: the exp and log of <cmath> bind to GLIBC_2.29's new versions; the static
// libstdc++ (setup.py's link_args, with a C++11-ABI torch) was compiled against the build host's
// glibc and brings fstat64 (2.33), pthread_once (2.34, when libpthread moved into libc), arc4random
// (2.36, std::random_device) and __libc_single_threaded (2.32, shared_ptr's reference counts).
// glibc 2.38's headers also rename strtol and its kin to C23 versions (__isoc23_strtol, which
// read a 0b prefix as well) for C++ code, ours and libstdc++'s alike.
// setup.py links with -Wl,--wrap=NAME for each __wrap_NAME defined here (glibc_compat_wraps
// there), which sends every reference to NAME in _C's objects and in the static libstdc++ to
// __wrap_NAME. Without those flags (the CMake build of the C++ tests) the definitions go unused.
//
// Only x86_64 glibc builds (their oldest symbol versions are GLIBC_2.2.5); elsewhere this file is
// empty and setup.py wraps nothing.
#include <cerrno>
#include <cstdint>  // first: on glibc it defines __GLIBC__ (features.h)

#if defined(__linux__) && defined(__x86_64__) && defined(__GLIBC__)

#include <sys/random.h>
#include <sys/stat.h>

extern "C" {

// The versions glibc 2.28 exports: exp and log from 2.2.5 (2.29 added new default versions, the
// same functions without the SVID error handling), __fxstat64 (what fstat64 called before 2.33),
// pthread_once from libpthread (kept as a compatibility symbol of libc since 2.34).
double safeattn_exp_2_2_5(double);
double safeattn_log_2_2_5(double);
int safeattn_fxstat64_2_2_5(int, int, struct stat64*);
int safeattn_pthread_once_2_2_5(void*, void (*)());
long safeattn_strtol_2_2_5(const char*, char**, int);
unsigned long safeattn_strtoul_2_2_5(const char*, char**, int);
long long safeattn_strtoll_2_2_5(const char*, char**, int);
unsigned long long safeattn_strtoull_2_2_5(const char*, char**, int);
__asm__(".symver safeattn_exp_2_2_5, exp@GLIBC_2.2.5");
__asm__(".symver safeattn_log_2_2_5, log@GLIBC_2.2.5");
__asm__(".symver safeattn_fxstat64_2_2_5, __fxstat64@GLIBC_2.2.5");
__asm__(".symver safeattn_pthread_once_2_2_5, pthread_once@GLIBC_2.2.5");
__asm__(".symver safeattn_strtol_2_2_5, strtol@GLIBC_2.2.5");
__asm__(".symver safeattn_strtoul_2_2_5, strtoul@GLIBC_2.2.5");
__asm__(".symver safeattn_strtoll_2_2_5, strtoll@GLIBC_2.2.5");
__asm__(".symver safeattn_strtoull_2_2_5, strtoull@GLIBC_2.2.5");

__attribute__((visibility("hidden"))) double __wrap_exp(double x) {
  return safeattn_exp_2_2_5(x);
}

__attribute__((visibility("hidden"))) double __wrap_log(double x) {
  return safeattn_log_2_2_5(x);
}

// struct stat64's layout on x86_64 is _STAT_VER_LINUX = 1 of __fxstat64.
__attribute__((visibility("hidden"))) int __wrap_fstat64(int fd, struct stat64* buf) {
  return safeattn_fxstat64_2_2_5(1, fd, buf);
}

__attribute__((visibility("hidden"))) int __wrap_pthread_once(void* once, void (*init)()) {
  return safeattn_pthread_once_2_2_5(once, init);
}

// The C23 conversions as C17's (no 0b prefix): nothing in safeattn or libstdc++'s number parsing
// passes one.
__attribute__((visibility("hidden"))) long __wrap___isoc23_strtol(const char* s, char** end, int base) {
  return safeattn_strtol_2_2_5(s, end, base);
}

__attribute__((visibility("hidden"))) unsigned long __wrap___isoc23_strtoul(const char* s, char** end, int base) {
  return safeattn_strtoul_2_2_5(s, end, base);
}

__attribute__((visibility("hidden"))) long long __wrap___isoc23_strtoll(const char* s, char** end, int base) {
  return safeattn_strtoll_2_2_5(s, end, base);
}

__attribute__((visibility("hidden"))) unsigned long long __wrap___isoc23_strtoull(const char* s, char** end, int base) {
  return safeattn_strtoull_2_2_5(s, end, base);
}

// arc4random's contract (never fails, never blocks once the kernel's pool is ready) from
// getrandom, which glibc has exported since 2.25.
__attribute__((visibility("hidden"))) uint32_t __wrap_arc4random() {
  uint32_t value = 0;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&value);
  size_t got = 0;
  while (got < sizeof value) {
    const ssize_t n = getrandom(bytes + got, sizeof value - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      break;  // no getrandom (Linux before 3.17; manylinux_2_28's systems have it)
    }
  }
  return value;
}

// 0: "other threads may exist", so libstdc++ always takes its atomic path (what it does anyway
// once a process has started a thread; torch's always have).
__attribute__((visibility("hidden"))) char __wrap___libc_single_threaded = 0;

}  // extern "C"

#endif
