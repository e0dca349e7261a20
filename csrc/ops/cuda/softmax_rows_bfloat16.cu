// The last-dim softmax kernels (softmax_rows.cuh) for bfloat16, in a file of their own so that the
// dtypes compile in parallel.
#include "ops/cuda/softmax_rows.cuh"

namespace safeattn::cuda {

SAFEATTN_SOFTMAX_ROWS_INSTANCES(, c10::BFloat16);

}  // namespace safeattn::cuda
