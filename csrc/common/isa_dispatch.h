// Run-time choice among the CPU ISA variants of a kernel.
//
// Every csrc/ops/cpu/*_kernel.cpp is compiled once per ISA with
// -DCPU_CAPABILITY=<ISA> -DCPU_CAPABILITY_<ISA> and that ISA's compiler flags (setup.py,
// CMakeLists.txt), so at::vec::Vectorized<T> resolves to SSE/AVX2/AVX-512 (NEON on aarch64,
// where only DEFAULT is built). Each variant stores its function pointer in the op's IsaStub
// at static-initialisation time; the op's CPU entry point calls stub.pick(), which returns
// the best variant the running CPU supports, as ATen's own DispatchStub does (and honouring
// ATEN_CPU_CAPABILITY, since at::get_cpu_capability() does).
#pragma once

#include <array>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace safeattn::cpu {

// Ordered: a CPU that runs one variant runs every lower one.
enum class Isa : int { DEFAULT = 0, AVX2 = 1, AVX512 = 2 };
constexpr int kNumIsas = 3;

const char* isa_name(Isa isa);

// The ISA ATen runs with on this CPU (at::get_cpu_capability()).
Isa runtime_isa();

// Whether this CPU executes a variant's instructions (the flags setup.py compiles it with). Not
// runtime_isa(): ATen may prefer AVX2 on a CPU with AVX-512, and it takes ATEN_CPU_CAPABILITY at
// its word, even above what the CPU runs (SIGILL).
bool cpu_runs(Isa isa);

// Records that a variant was compiled, for build_info(); called by the registration macro.
void note_compiled_isa(Isa isa);
std::vector<std::string> compiled_isas();
// The compiled variants this CPU executes (cpu_runs), lowest first.
std::vector<std::string> runnable_isas();

template <typename Fn>
struct IsaStub {
  const char* name;
  std::array<Fn, kNumIsas> variants{};

  explicit IsaStub(const char* op_name) : name(op_name) {}

  // The fastest compiled variant that this CPU can run.
  Fn pick() const {
    for (int i = static_cast<int>(runtime_isa()); i >= 0; --i) {
      if (variants[i] != nullptr) {
        return variants[i];
      }
    }
    TORCH_CHECK(false, "safeattn: no CPU kernel was compiled for ", name);
  }

  // A specific variant, or nullptr when it was not compiled (tests compare variants).
  Fn get(Isa isa) const {
    return variants[static_cast<int>(isa)];
  }
};

}  // namespace safeattn::cpu

// In an op header: declares the accessor of the op's stub.
#define SAFEATTN_DECLARE_ISA_STUB(stub, FnType) ::safeattn::cpu::IsaStub<FnType>& stub()

// In the op's .cpp (compiled once): defines it. A function-local static, so kernel files
// can register into it during static initialisation in any order.
#define SAFEATTN_DEFINE_ISA_STUB(stub, FnType)               \
  ::safeattn::cpu::IsaStub<FnType>& stub() {                 \
    static ::safeattn::cpu::IsaStub<FnType> instance{#stub}; \
    return instance;                                         \
  }

#define SAFEATTN_ISA_CONCAT_(a, b) a##b
#define SAFEATTN_ISA_CONCAT(a, b) SAFEATTN_ISA_CONCAT_(a, b)

// At the bottom of a kernel file: stores this ISA variant of `fn` in the stub.
#define SAFEATTN_REGISTER_ISA_KERNEL(stub, fn)                                 \
  static const bool SAFEATTN_ISA_CONCAT(registered_##stub##_, __LINE__) = [] { \
    constexpr auto isa = ::safeattn::cpu::Isa::CPU_CAPABILITY;                 \
    stub().variants[static_cast<int>(isa)] = (fn);                             \
    ::safeattn::cpu::note_compiled_isa(isa);                                   \
    return true;                                                               \
  }()
