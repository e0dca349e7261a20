// Lives in csrc/common/ and is compiled once (not per ISA): it holds the shared registry.
#include "common/isa_dispatch.h"

#include <algorithm>
#include <mutex>

#include <ATen/Version.h>

namespace safeattn::cpu {

const char* isa_name(Isa isa) {
  static constexpr const char* kNames[kNumIsas] = {"DEFAULT", "AVX2", "AVX512"};  // by Isa's value
  const int index = static_cast<int>(isa);
  return index >= 0 && index < kNumIsas ? kNames[index] : "?";
}

Isa runtime_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  // ATen's exported query (its enum-valued twin is internal); computed once, as ATen does.
  static const Isa isa = [] {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") {
      return Isa::AVX512;
    }
    return capability == "AVX2" ? Isa::AVX2 : Isa::DEFAULT;
  }();
  return isa;
#else
  // aarch64 and others: only the DEFAULT variant is built (NEON comes with the default flags).
  return Isa::DEFAULT;
#endif
}

bool cpu_runs(Isa isa) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  switch (isa) {
    case Isa::AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
    case Isa::AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::DEFAULT:
      return true;
  }
  return false;
#else
  return isa == Isa::DEFAULT;
#endif
}

namespace {
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::array<bool, kNumIsas>& compiled_flags() {
  static std::array<bool, kNumIsas> flags{};
  return flags;
}
}  // namespace

void note_compiled_isa(Isa isa) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  compiled_flags()[static_cast<int>(isa)] = true;
}

std::vector<std::string> compiled_isas() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (int i = 0; i < kNumIsas; ++i) {
    if (compiled_flags()[i]) {
      names.emplace_back(isa_name(static_cast<Isa>(i)));
    }
  }
  return names;
}

std::vector<std::string> runnable_isas() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (int i = 0; i < kNumIsas; ++i) {
    if (compiled_flags()[i] && cpu_runs(static_cast<Isa>(i))) {
      names.emplace_back(isa_name(static_cast<Isa>(i)));
    }
  }
  return names;
}

}  // namespace safeattn::cpu
