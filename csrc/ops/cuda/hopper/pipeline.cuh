// The warp-specialised skeleton every sm_90a attention kernel shares. Contract: a CTA is one
// producer warpgroup (warpgroup 0; one of its threads issues the TMA loads) and consumer
// warpgroups (wgmma); run_roles is called by every thread once the CTA's barriers are
// initialised, moves registers from the producer to the consumers (setmaxnreg) and runs each
// role. Named barrier ids come from NamedBarrier alone (0 is __syncthreads); what crosses from the
// producer to the consumers beside the TMA data goes through shared memory published by the load's
// mbarrier (hopper/mask.cuh, TileVisit).
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

namespace safeattn::cuda::hopper::detail {

// The named barriers of the consumer warpgroups, per kernel (ids may repeat across kernels).
enum NamedBarrier : int {
  // Forward: consumer warpgroup w's ping-pong turn is kFwdTurn + w (at most 3 warpgroups), synced
  // by w and arrived at by its predecessor.
  kFwdTurn = 1,
  // Forward: consumer warpgroup w staged its output in the Q buffer (kFwdOStaged + w).
  kFwdOStaged = 4,
  // dK/dV kernel: both consumer warpgroups wrote their dS (kBwdDsWritten + step % 2 where one
  // warpgroup multiplies dQ per step); warpgroup w staged its dQ (kBwdDqStaged + w); both wrote
  // their P^T (64-key tiles shared by both).
  kBwdDsWritten = 1,
  kBwdDqStaged = 3,
  kBwdPWritten = 5,
  // dK/dV kernel: both consumer warpgroups are past their last product, then wrote their dK and
  // dV rows into K's and V's buffers (Bwd::store_dkv_staged).
  kBwdDkvStaged = 6,
};

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The parameters of a TMA pipeline of one CTA (cluster 1x1x1): `bytes` land per stage, thread 0
// leads the producer side, `consumers` threads release each stage.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(uint32_t bytes, bool producer, int consumers) {
  typename Pipeline::Params params;
  params.transaction_bytes = bytes;
  params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumers;
  return params;
}
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

// The kernel's shared storage, in the dynamic shared memory of the launch.
template <class SharedStorage>
__device__ __forceinline__ SharedStorage& shared_storage() {
  extern __shared__ char smem_raw[];
  return *reinterpret_cast<SharedStorage*>(smem_raw);
}

// Whether this thread is in the producer warpgroup (warp-uniform to the compiler).
__device__ __forceinline__ bool in_producer_warpgroup() {
  const int warp = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 32, 0);
  return warp / 4 == 0;
}

// The roles: the producer warpgroup gives registers back and runs produce() on its thread 0 (the
// one TMA issuer); the consumer warpgroups take them and run consume(). setmaxnreg.inc waits until
// the pool has the registers, so the split must fit in what the launch bound gave the CTA.
template <int kProducerRegs, int kConsumerRegs, class Produce, class Consume>
__device__ __forceinline__ void run_roles(bool producer, Produce&& produce, Consume&& consume) {
  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) {
      produce();
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume();
  }
}

}  // namespace safeattn::cuda::hopper::detail
