// Batched fp32 matmul for XLA:CPU, as an XLA FFI handler: C[b] = op(A[b]) @ op(B[b]).
//
// Why: XLA:CPU runs a batched dot as one Eigen contraction per batch element, each split
// over the intra-op threads. For the many small GEMMs of an expert FFN ([E, C, M] x [E, M, H]
// with C around 128) the split costs more than it gains. Here each batch element (or a block
// of its rows) is one single-threaded OpenBLAS sgemm, and the tasks are spread over XLA's
// own intra-op thread pool, so OpenBLAS never starts threads of its own.
//
// Layout: row-major, leading dimensions are the batch (their product is the batch size).
//   A: [..., m, k], or [..., k, m] with trans_a.   B: [..., k, n], or [..., n, k] with trans_b.
//   C: [..., m, n].

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cblas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// OpenBLAS stays single-threaded: the parallelism comes from XLA's thread pool.
const int kOpenBlasSingleThreaded = (scipy_openblas_set_num_threads(1), 0);

// Rows of C per task are never split below this (a thinner GEMM loses more than it gains).
constexpr int64_t kMinRowsPerTask = 32;

struct Shape {
  int64_t batch, m, n, k;
};

ffi::ErrorOr<Shape> InferShape(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b,
                               ffi::Span<const int64_t> c, bool trans_a, bool trans_b) {
  const size_t rank = a.size();
  if (rank < 2 || b.size() != rank || c.size() != rank) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("batched_matmul: A, B and C need the same rank >= 2"));
  }
  Shape s{1, trans_a ? a[rank - 1] : a[rank - 2], trans_b ? b[rank - 2] : b[rank - 1],
          trans_a ? a[rank - 2] : a[rank - 1]};
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (a[i] != b[i] || a[i] != c[i]) {
      return ffi::Unexpected(ffi::Error::InvalidArgument("batched_matmul: batch dimensions differ"));
    }
    s.batch *= a[i];
  }
  const int64_t k_b = trans_b ? b[rank - 1] : b[rank - 2];
  if (k_b != s.k || c[rank - 2] != s.m || c[rank - 1] != s.n) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("batched_matmul: contracting or output sizes differ"));
  }
  return s;
}

// Asks the kernel for 2 MiB pages on the (fresh, untouched) output: XLA allocates it anew on
// every call, and first-touch faults on 4 KiB pages cost as much as a third of the GEMM.
void AdviseHugePages(float* data, int64_t elements) {
  const uintptr_t huge = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t lo = (begin + huge - 1) & ~(huge - 1);
  const uintptr_t hi = (begin + sizeof(float) * elements) & ~(huge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // best effort
}

// Tasks are claimed from a shared counter by the caller and by helpers on the pool. The
// caller can finish every task alone, so a busy pool only costs speed; the state is shared so
// that a helper starting late finds no task left and returns without touching freed memory.
struct Tasks {
  explicit Tasks(int64_t total) : total(total) {}
  const int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

ffi::Error BatchedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                             ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c,
                             bool trans_a, bool trans_b) {
  (void)kOpenBlasSingleThreaded;
  ffi::ErrorOr<Shape> shape =
      InferShape(a.dimensions(), b.dimensions(), c->dimensions(), trans_a, trans_b);
  if (shape.has_error()) return shape.error();
  const Shape s = shape.value();
  float* out = c->typed_data();
  if (s.batch * s.m * s.n == 0) return ffi::Error::Success();
  if (s.k == 0) {
    std::fill(out, out + s.batch * s.m * s.n, 0.0f);
    return ffi::Error::Success();
  }
  AdviseHugePages(out, s.batch * s.m * s.n);

  // Split each batch element's rows so there are at least two tasks per thread.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t wanted = std::max<int64_t>(1, (2 * threads + s.batch - 1) / s.batch);
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, s.m / kMinRowsPerTask));
  const int64_t rows = (s.m + splits - 1) / splits;
  auto tasks = std::make_shared<Tasks>(s.batch * splits);

  const float* A = a.typed_data();
  const float* B = b.typed_data();
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  const int64_t lda = trans_a ? s.m : s.k, ldb = trans_b ? s.k : s.n;
  auto run = [=]() {
    for (int64_t t; (t = tasks->next.fetch_add(1)) < tasks->total;) {
      const int64_t i = t / splits, r0 = (t % splits) * rows;
      const int64_t r = std::min(rows, s.m - r0);
      if (r > 0) {
        // Row block r0 of op(A): rows of A, or columns of A when it is transposed.
        const float* a_i = A + i * s.m * s.k + (trans_a ? r0 : r0 * lda);
        scipy_cblas_sgemm(CblasRowMajor, ta, tb, r, s.n, s.k, 1.0f, a_i, lda,
                          B + i * s.k * s.n, ldb, 0.0f, out + i * s.m * s.n + r0 * s.n, s.n);
      }
      if (tasks->done.fetch_add(1) + 1 == tasks->total) {
        std::lock_guard<std::mutex> lock(tasks->mu);
        tasks->all_done.notify_all();
      }
    }
  };
  const int64_t helpers = std::min(threads, tasks->total) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  std::unique_lock<std::mutex> lock(tasks->mu);
  tasks->all_done.wait(lock, [&] { return tasks->done.load() == tasks->total; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspeedBatchedMatmul, BatchedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
