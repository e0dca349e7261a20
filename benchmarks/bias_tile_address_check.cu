// Host check (no GPU needed) of the addresses from which the sm_90a forward reads a bias tile with
// ldmatrix (hopper/fwd_kernel.cuh, add_bias_tile): for every row block, lane, 16-key step m and
// stage, the address computed from one per-thread base (XOR 32 (m % 4), plus (m / 4) 64-key atoms,
// plus the stage) equals CuTe's swizzled address of that element of SmemLayoutBiasTile, and the
// eight elements of each 16-byte row piece are contiguous. Build and run (repository root):
//
//   nvcc -std=c++17 -O1 --expt-relaxed-constexpr -Icsrc -I"$CUTLASS_INCLUDE" \
//        benchmarks/bias_tile_address_check.cu -o bias_tile_address_check && ./bias_tile_address_check
//
// Exit status 1 when an address differs (with + in place of the XOR: 1792 of 4096 wrong).
#include <cstdint>
#include <cstdio>
#include "ops/cuda/hopper/tile_traits.cuh"
using namespace cute;
template <typename Element, int kRows, int kKeys, int kStages>
int check() {
  using L = safeattn::cuda::hopper::detail::SmemLayoutBiasTile<Element, kRows, kKeys, kStages>;
  alignas(1024) static Element buf[cosize_v<L>];
  auto t = make_tensor(make_smem_ptr(buf), L{});
  using Plain = decltype(get_nonswizzle_portion(L{}));
  const uint32_t atom = kKeys > 64 ? Plain{}(0, 64, 0) * sizeof(Element) : 0;
  const uint32_t stage_bytes = Plain{}(0, 0, 1) * sizeof(Element);
  auto addr = [&](int r, int k, int s) {
    return uint32_t(reinterpret_cast<uintptr_t>(&t(r, k, s)) - reinterpret_cast<uintptr_t>(buf));
  };
  int bad = 0, n = 0;
  for (int warp_row = 0; warp_row < kRows; warp_row += 16)
    for (int lane = 0; lane < 32; ++lane)
      for (int s = 0; s < kStages; ++s) {
        const int block = lane / 8, row = warp_row + 8 * (block % 2) + lane % 8;
        const uint32_t base = addr(row, 8 * (block / 2), 0) + s * stage_bytes;
        for (int m = 0; m < kKeys / 16; ++m) {
          const uint32_t got = (base ^ (32 * (m % 4))) + (m / 4) * atom;
          const uint32_t want = addr(row, 16 * m + 8 * (block / 2), s);
          // the 8 elements of the 16-byte row piece are contiguous
          for (int e = 1; e < 8; ++e)
            bad += addr(row, 16 * m + 8 * (block / 2) + e, s) != want + 2 * e;
          bad += got != want;
          ++n;
        }
      }
  printf("rows %d keys %d stages %d elem %d: %d of %d addresses wrong\n", kRows, kKeys, kStages, int(sizeof(Element)),
         bad, n);
  return bad;
}
int main() {
  int bad = check<cutlass::bfloat16_t, 128, 128, 2>() + check<cutlass::half_t, 128, 128, 2>() +
            check<cutlass::bfloat16_t, 128, 64, 2>() + check<cutlass::bfloat16_t, 192, 128, 4>() +
            check<cutlass::bfloat16_t, 128, 128, 1>();
  return bad != 0;
}
