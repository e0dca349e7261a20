// The last-dim softmax kernels (softmax_rows.cuh) for double, in a file of their own so that the
// dtypes compile in parallel.
#include "ops/cuda/softmax_rows.cuh"

namespace safeattn::cuda {

using Scalar = double;
template void launch_softmax_rows<Scalar>(const Scalar*, Scalar*, int64_t, int64_t, const void*, const MaskGeometry&,
                                          acc_type_t<Scalar>, cudaStream_t);
template void launch_softmax_backward_rows<Scalar>(const Scalar*, const Scalar*, Scalar*, acc_type_t<Scalar>*, int64_t,
                                                   int64_t, acc_type_t<Scalar>, cudaStream_t);

}  // namespace safeattn::cuda
