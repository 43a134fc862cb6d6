// fp32 matmuls for XLA:CPU, as XLA FFI handlers:
//   JaxspeedBatchedMatmul  C[b] = op(A[b]) @ op(B[b])
//   JaxspeedGroupedMatmul  out[rows of group g] = lhs[rows of group g] @ op(rhs[g])
//                          (jax.lax.ragged_dot: rows sorted by group, sizes given at run time)
//   JaxspeedGroupedOuter   out[g] = lhs[rows of group g]^T @ rhs[rows of group g]
//                          (the weight gradient of the grouped matmul)
//
// Why: XLA:CPU runs a batched dot as one Eigen contraction per batch element, each split
// over the intra-op threads. For the many small GEMMs of an expert FFN ([E, C, M] x [E, M, H]
// with C around 128) the split costs more than it gains. Here each batch element (or a block
// of its rows) is one single-threaded OpenBLAS sgemm, and the tasks are spread over XLA's
// own intra-op thread pool, so OpenBLAS never starts threads of its own.
//
// Layout: row-major. Batched: leading dimensions are the batch (their product is the batch
// size); A: [..., m, k], or [..., k, m] with trans_a; B: [..., k, n], or [..., n, k] with
// trans_b; C: [..., m, n]. Grouped: lhs [N, K]; rhs [G, K, P] or [G, P, K] with trans_b;
// group_sizes int32 [G]; rows past the last group are zero, as in ragged_dot.

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cblas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// OpenBLAS stays single-threaded: the parallelism comes from XLA's thread pool.
const int kOpenBlasSingleThreaded = (scipy_openblas_set_num_threads(1), 0);

// Rows of C per task are never split below this (a thinner GEMM loses more than it gains).
constexpr int64_t kMinRowsPerTask = 32;

ffi::Unexpected<ffi::Error> Invalid(const char* message) {
  return ffi::Unexpected(ffi::Error::InvalidArgument(message));
}

struct Shape {
  int64_t batch, m, n, k;
};

ffi::ErrorOr<Shape> InferShape(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b,
                               ffi::Span<const int64_t> c, bool trans_a, bool trans_b) {
  const size_t rank = a.size();
  if (rank < 2 || b.size() != rank || c.size() != rank) {
    return Invalid("batched_matmul: A, B and C need the same rank >= 2");
  }
  Shape s{1, trans_a ? a[rank - 1] : a[rank - 2], trans_b ? b[rank - 2] : b[rank - 1],
          trans_a ? a[rank - 2] : a[rank - 1]};
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (a[i] != b[i] || a[i] != c[i]) {
      return Invalid("batched_matmul: batch dimensions differ");
    }
    s.batch *= a[i];
  }
  const int64_t k_b = trans_b ? b[rank - 1] : b[rank - 2];
  if (k_b != s.k || c[rank - 2] != s.m || c[rank - 1] != s.n) {
    return Invalid("batched_matmul: contracting or output sizes differ");
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

// Runs task(0) ... task(total - 1) on the caller and the pool's threads; returns when all ran.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t total, F task) {
  if (total <= 0) return;
  auto tasks = std::make_shared<Tasks>(total);
  auto run = [tasks, task]() {
    for (int64_t t; (t = tasks->next.fetch_add(1)) < tasks->total;) {
      task(t);
      if (tasks->done.fetch_add(1) + 1 == tasks->total) {
        std::lock_guard<std::mutex> lock(tasks->mu);
        tasks->all_done.notify_all();
      }
    }
  };
  const int64_t helpers = std::min(std::max<int64_t>(1, pool.num_threads()), total) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    auto copy = run;
    pool.Schedule(std::move(copy));
  }
  run();
  std::unique_lock<std::mutex> lock(tasks->mu);
  tasks->all_done.wait(lock, [&] { return tasks->done.load() == tasks->total; });
}

// How many row blocks to cut each of `items` GEMMs of `rows` rows into, so that there are at
// least two tasks per thread (never blocks thinner than kMinRowsPerTask).
int64_t RowSplits(ffi::ThreadPool& pool, int64_t items, int64_t rows) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  items = std::max<int64_t>(1, items);
  const int64_t wanted = std::max<int64_t>(1, (2 * threads + items - 1) / items);
  return std::max<int64_t>(1, std::min(wanted, rows / kMinRowsPerTask));
}

// C (r x n, ldc = n) = op(A) @ op(B) for the row block of op(A) that starts at r0: rows of A,
// or columns of A when it is transposed (lda is A's row length either way).
void GemmRows(bool trans_a, bool trans_b, int64_t r0, int64_t r, int64_t n, int64_t k,
              const float* A, int64_t lda, const float* B, int64_t ldb, float* C) {
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, r, n, k, 1.0f,
                    A + (trans_a ? r0 : r0 * lda), lda, B, ldb, 0.0f, C + r0 * n, n);
}

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

  const int64_t splits = RowSplits(pool, s.batch, s.m);
  const int64_t rows = (s.m + splits - 1) / splits;
  const float* A = a.typed_data();
  const float* B = b.typed_data();
  const int64_t lda = trans_a ? s.m : s.k, ldb = trans_b ? s.k : s.n;
  ParallelFor(pool, s.batch * splits, [=](int64_t t) {
    const int64_t i = t / splits, r0 = (t % splits) * rows;
    const int64_t r = std::min(rows, s.m - r0);
    if (r > 0) {
      GemmRows(trans_a, trans_b, r0, r, s.n, s.k, A + i * s.m * s.k, lda, B + i * s.k * s.n,
               ldb, out + i * s.m * s.n);
    }
  });
  return ffi::Error::Success();
}

// Start row of every group, and the rows they cover; an error if a size is negative or the
// groups need more rows than there are.
ffi::ErrorOr<std::vector<int64_t>> GroupStarts(ffi::Buffer<ffi::S32> sizes, int64_t rows) {
  const int64_t groups = sizes.element_count();
  std::vector<int64_t> starts(groups + 1, 0);
  const int32_t* n = sizes.typed_data();
  for (int64_t g = 0; g < groups; ++g) {
    if (n[g] < 0) {
      return Invalid("grouped matmul: negative group size");
    }
    starts[g + 1] = starts[g] + n[g];
  }
  if (starts[groups] > rows) {
    return Invalid("grouped matmul: the group sizes add up to more rows than lhs has");
  }
  return starts;
}

ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> lhs,
                             ffi::Buffer<ffi::F32> rhs, ffi::Buffer<ffi::S32> sizes,
                             ffi::ResultBuffer<ffi::F32> out, bool trans_b) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  const int64_t groups_given = sizes.element_count();
  if (ld.size() != 2 || rd.size() != 3 || od.size() != 2 || groups_given != rd[0]) {
    return ffi::Error::InvalidArgument("grouped matmul: lhs [N, K], rhs [G, ., .], sizes [G]");
  }
  const int64_t rows = ld[0], k = ld[1], groups = rd[0];
  const int64_t n = trans_b ? rd[1] : rd[2];
  if ((trans_b ? rd[2] : rd[1]) != k || od[0] != rows || od[1] != n) {
    return ffi::Error::InvalidArgument("grouped matmul: contracting or output sizes differ");
  }
  ffi::ErrorOr<std::vector<int64_t>> starts_or = GroupStarts(sizes, rows);
  if (starts_or.has_error()) return starts_or.error();
  const std::vector<int64_t> starts = starts_or.value();
  float* C = out->typed_data();
  AdviseHugePages(C, rows * n);
  const int64_t filled = k == 0 ? 0 : starts[groups];
  std::fill(C + filled * n, C + rows * n, 0.0f);  // rows past the last group are zero
  if (filled == 0 || n == 0) return ffi::Error::Success();

  const int64_t mean_rows = (rows + groups - 1) / std::max<int64_t>(1, groups);
  const int64_t splits = RowSplits(pool, groups, mean_rows);
  const float* A = lhs.typed_data();
  const float* B = rhs.typed_data();
  ParallelFor(pool, groups * splits, [=, &starts](int64_t t) {
    const int64_t g = t / splits, size = starts[g + 1] - starts[g];
    const int64_t block = (size + splits - 1) / splits, r0 = (t % splits) * block;
    const int64_t r = std::min(block, size - r0);
    if (r > 0) {
      GemmRows(false, trans_b, r0, r, n, k, A + starts[g] * k, k, B + g * k * n,
               trans_b ? k : n, C + starts[g] * n);
    }
  });
  return ffi::Error::Success();
}

ffi::Error GroupedOuterImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> lhs,
                            ffi::Buffer<ffi::F32> rhs, ffi::Buffer<ffi::S32> sizes,
                            ffi::ResultBuffer<ffi::F32> out) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  const int64_t groups = sizes.element_count();
  if (ld.size() != 2 || rd.size() != 2 || od.size() != 3 || ld[0] != rd[0] ||
      od[0] != groups || od[1] != ld[1] || od[2] != rd[1]) {
    return ffi::Error::InvalidArgument(
        "grouped outer: lhs [N, K], rhs [N, P], sizes [G], out [G, K, P]");
  }
  const int64_t rows = ld[0], k = ld[1], n = rd[1];
  ffi::ErrorOr<std::vector<int64_t>> starts_or = GroupStarts(sizes, rows);
  if (starts_or.has_error()) return starts_or.error();
  const std::vector<int64_t> starts = starts_or.value();
  float* C = out->typed_data();
  AdviseHugePages(C, groups * k * n);

  // Each output out[g] is (K x P); its rows are the columns of lhs, cut into blocks.
  const int64_t splits = RowSplits(pool, groups, k);
  const int64_t block = (k + splits - 1) / splits;
  const float* A = lhs.typed_data();
  const float* B = rhs.typed_data();
  ParallelFor(pool, groups * splits, [=, &starts](int64_t t) {
    const int64_t g = t / splits, r0 = (t % splits) * block;
    const int64_t r = std::min(block, k - r0), size = starts[g + 1] - starts[g];
    if (r <= 0) return;
    if (size == 0) {  // an expert without tokens: its gradient is zero
      std::fill(C + g * k * n + r0 * n, C + g * k * n + (r0 + r) * n, 0.0f);
    } else {
      GemmRows(true, false, r0, r, n, size, A + starts[g] * k, k, B + starts[g] * n, n,
               C + g * k * n);
    }
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspeedGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspeedGroupedOuter, GroupedOuterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
