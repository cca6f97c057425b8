// Host side of the warp-specialised sm_90a path: TMA tensor-map encoding. The
// driver's cuTensorMapEncodeTiled is fetched through the runtime (no libcuda link), once.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdio>

#include "sm90/sm90_ws.h"

namespace dualkv::cuda::detail {

void warn_ws_fallback(const char* why) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    std::fprintf(stderr,
                 "dualkv: the warp-specialised sm_90a kernels cannot run (%s); "
                 "using the sm_80 kernels; "
                 "warned once, later fallbacks are silent\n",
                 why);
  }
}

namespace {
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  // Function-local static: initialised once, thread-safe.
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // do not leave the lookup's error for the next launch check
      return PFN_cuTensorMapEncodeTiled_v12000(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}
}  // namespace

bool encode_tmap_thd(CUtensorMap_st* map, const void* base, int T, int H, int D, int64_t tok_stride,
                     int64_t head_stride, int rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = encoder();
  if (!fn || T <= 0 || H <= 0) return false;
  // Dims innermost first: columns, heads, tokens. With one head its stride is never used; give
  // it a harmless value (a zero stride would be rejected).
  const cuuint64_t dims[3] = {cuuint64_t(D), cuuint64_t(H), cuuint64_t(T)};
  const cuuint64_t strides[2] = {cuuint64_t(H == 1 ? D : head_stride) * 2,
                                 cuuint64_t(tok_stride) * 2};
  const cuuint32_t box[3] = {64, 1, cuuint32_t(rows)};
  const cuuint32_t estride[3] = {1, 1, 1};
  // Out-of-range tokens (past T) read as zeros.
  const CUresult r =
      fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box,
         estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace dualkv::cuda::detail
