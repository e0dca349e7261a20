// csrc/common/glibc_compat.cpp's redirects, called directly (this test compiles that file in; in
// _C the functions are hidden and reached through setup.py's --wrap link flags): each gives what
// the glibc function it replaces gives, so a wheel linked to glibc 2.28's versions behaves the
// same. x86_64 glibc only, as the file.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>

#include <cstdint>  // defines __GLIBC__ on glibc

#if defined(__linux__) && defined(__x86_64__) && defined(__GLIBC__)

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>

extern "C" {
double __wrap_exp(double);
double __wrap_log(double);
int __wrap_fstat64(int, struct stat64*);
int __wrap_pthread_once(void*, void (*)());
long __wrap___isoc23_strtol(const char*, char**, int);
unsigned long __wrap___isoc23_strtoul(const char*, char**, int);
long long __wrap___isoc23_strtoll(const char*, char**, int);
unsigned long long __wrap___isoc23_strtoull(const char*, char**, int);
uint32_t __wrap_arc4random();
extern char __wrap___libc_single_threaded;
}

namespace {

int once_calls = 0;
void count_once() {
  ++once_calls;
}

}  // namespace

CATCH_TEST_CASE("glibc 2.28's exp and log give glibc's values", "[glibc_compat]") {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (double x : {-745.2, -20.5, -1.0, -0.0, 0.0, 1e-300, 0.5, 1.0, 2.302585092994046, 88.7, 709.7, 710.0}) {
    CATCH_CHECK(__wrap_exp(x) == std::exp(x));
  }
  CATCH_CHECK(__wrap_exp(-kInf) == 0.0);
  CATCH_CHECK(__wrap_exp(kInf) == kInf);
  CATCH_CHECK(std::isnan(__wrap_exp(std::nan(""))));
  for (double x : {1e-310, 1e-300, 0.25, 1.0, 2.718281828459045, 10.0, 1e300}) {
    CATCH_CHECK(__wrap_log(x) == std::log(x));
  }
  CATCH_CHECK(__wrap_log(0.0) == -kInf);
  CATCH_CHECK(std::isnan(__wrap_log(-1.0)));
}

CATCH_TEST_CASE("fstat64 through __fxstat64 sees the file", "[glibc_compat]") {
  char path[] = "/tmp/safeattn_glibc_compat_XXXXXX";
  const int fd = mkstemp(path);
  CATCH_REQUIRE(fd >= 0);
  CATCH_REQUIRE(write(fd, "12345", 5) == 5);
  struct stat64 ours {};
  struct stat64 theirs {};
  CATCH_CHECK(__wrap_fstat64(fd, &ours) == 0);
  CATCH_CHECK(fstat64(fd, &theirs) == 0);
  CATCH_CHECK(ours.st_size == 5);
  CATCH_CHECK(ours.st_ino == theirs.st_ino);
  CATCH_CHECK(ours.st_mode == theirs.st_mode);
  close(fd);
  unlink(path);
  CATCH_CHECK(__wrap_fstat64(fd, &ours) == -1);  // closed: an error, as fstat64's
}

CATCH_TEST_CASE("pthread_once runs its function once", "[glibc_compat]") {
  pthread_once_t once = PTHREAD_ONCE_INIT;
  CATCH_CHECK(__wrap_pthread_once(&once, count_once) == 0);
  CATCH_CHECK(__wrap_pthread_once(&once, count_once) == 0);
  CATCH_CHECK(once_calls == 1);
}

CATCH_TEST_CASE("the C23 conversions parse as C17's", "[glibc_compat]") {
  char* end = nullptr;
  const char text[] = "-42 rest";
  CATCH_CHECK(__wrap___isoc23_strtol(text, &end, 10) == -42);
  CATCH_CHECK(end == text + 3);
  CATCH_CHECK(__wrap___isoc23_strtol("0x1f", nullptr, 0) == 31);
  CATCH_CHECK(__wrap___isoc23_strtol("010", nullptr, 0) == 8);
  CATCH_CHECK(__wrap___isoc23_strtoul("4294967296", nullptr, 10) == 4294967296UL);
  CATCH_CHECK(__wrap___isoc23_strtoll("-9223372036854775807", nullptr, 10) == -9223372036854775807LL);
  CATCH_CHECK(__wrap___isoc23_strtoull("18446744073709551615", nullptr, 10) == 18446744073709551615ULL);
}

CATCH_TEST_CASE("arc4random gives random words and libstdc++ never takes its single-thread path", "[glibc_compat]") {
  std::set<uint32_t> seen;
  for (int i = 0; i < 8; ++i) {
    seen.insert(__wrap_arc4random());
  }
  CATCH_CHECK(seen.size() > 1);  // 8 equal 32-bit draws: probability 2^-224
  CATCH_CHECK(__wrap___libc_single_threaded == 0);
}

#endif
