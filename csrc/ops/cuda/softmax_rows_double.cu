// The last-dim softmax kernels (softmax_rows.cuh) for double, in a file of their own so that the
// dtypes compile in parallel.
#include "ops/cuda/softmax_rows.cuh"

namespace safeattn::cuda {

SAFEATTN_SOFTMAX_ROWS_INSTANCES(, double);

}  // namespace safeattn::cuda
