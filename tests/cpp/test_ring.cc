// Self-test of the engine and ring without Python, run under mpirun by
// tests/test_sanitizers.py with AddressSanitizer and UBSan.
//
// Integer-valued data keeps every partial sum exact, so results are compared
// for equality with MPI_Allreduce's; a hash compared across ranks checks that
// every rank ends bitwise identical.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "allreduce/ring.h"
#include "comm_context.h"
#include "dtype.h"
#include "engine.h"
#include "shm_links.h"

using namespace pipesgd;

namespace {

int failures = 0;

#define EXPECT(cond, ...)                                        \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                         \
      std::fprintf(stderr, "\n");                                \
      ++failures;                                                \
    }                                                            \
  } while (0)

std::uint64_t fnv1a(const void* data, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ULL;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

bool same_on_all_ranks(const void* data, std::size_t bytes) {
  const std::uint64_t h = fnv1a(data, bytes);
  std::uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

void check_float32(Engine& engine, std::size_t count, Compression compression, int rank) {
  std::vector<float> data(count);
  for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(rank)) % 13) - 6.0f;
  std::vector<float> expect(count);
  MPI_Allreduce(data.data(), expect.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                MPI_COMM_WORLD);
  auto op = engine.allreduce(data.data(), count, DType::kFloat32, ReduceOp::kSum, compression);
  op->wait(-1);
  EXPECT(op->status() == OpStatus::kDone, "%s: %s", op->describe().c_str(), op->error().c_str());
  if (compression == Compression::kNone) {
    for (std::size_t i = 0; i < count; ++i) {
      if (data[i] != expect[i]) {
        EXPECT(false, "count %zu element %zu: %g != %g", count, i, double(data[i]), double(expect[i]));
        break;
      }
    }
  } else {
    double worst = 0;
    for (std::size_t i = 0; i < count; ++i) worst = std::fmax(worst, std::fabs(data[i] - expect[i]));
    EXPECT(worst <= 0.5 * engine.size() * 6.0, "compressed error %g too large", worst);
  }
  EXPECT(same_on_all_ranks(data.data(), count * sizeof(float)), "count %zu differs across ranks", count);
}

void check_half(Engine& engine, std::size_t count, int rank) {
  std::vector<std::uint16_t> data(count);
  std::vector<float> local(count), expect(count);
  for (std::size_t i = 0; i < count; ++i) {
    local[i] = static_cast<float>((i + static_cast<std::size_t>(rank)) % 5);
    data[i] = float_to_half(local[i]);
  }
  MPI_Allreduce(local.data(), expect.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  auto op = engine.allreduce(data.data(), count, DType::kFloat16, ReduceOp::kAverage, Compression::kNone);
  op->wait(-1);
  EXPECT(op->status() == OpStatus::kDone, "%s", op->error().c_str());
  for (std::size_t i = 0; i < count; ++i) {
    const float want = expect[i] / static_cast<float>(engine.size());
    if (std::fabs(half_to_float(data[i]) - want) > 1e-2f) {
      EXPECT(false, "float16 element %zu: %g != %g", i, double(half_to_float(data[i])), double(want));
      break;
    }
  }
}

// A ring whose edges are chosen one by one, as across nodes: ranks in pairs play the
// nodes, so edges within a pair are shared-memory links and those between pairs MPI
// messages (p = 4: both kinds at every rank; p = 3: rank 2 alone on MPI). Integer-valued
// float32 and float64 sums equal MPI's exactly; compressed ones stay within the
// compression error; every rank ends bitwise identical.
void check_mixed_ring(int rank, int size) {
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  CommContext ctx(dup, EngineConfig{}, /*shared_memory=*/false, /*core_per_rank=*/false,
                  std::make_shared<std::atomic<int>>(0), WaitedPolling::kSleep);
  const bool left = (rank - 1 + size) % size / 2 == rank / 2;
  const bool right = (rank + 1) % size / 2 == rank / 2;
  std::string why_not;
  auto links = ShmLinks::create(ctx.comm(), 4096, 4, left, right, &why_not);
  EXPECT(links != nullptr, "no links: %s", why_not.c_str());
  if (links == nullptr) return;
  EXPECT(links->reaches_left() == left && links->reaches_right() == right,
         "rank %d: links reach (%d, %d), expected (%d, %d)", rank, links->reaches_left(),
         links->reaches_right(), left, right);
  const RingPath path{links.get(), 4096, 4};
  Workspace workspace;
  std::uint64_t seq = 0;
  for (const std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{70001}}) {
    for (const Compression compression :
         {Compression::kNone, Compression::kTrunc16, Compression::kQuant8}) {
      std::vector<float> data(count), expect(count);
      for (std::size_t i = 0; i < count; ++i) {
        data[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(rank)) % 13) - 6.0f;
      }
      MPI_Allreduce(data.data(), expect.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
      Operation op;
      op.seq = seq++;
      op.data = data.data();
      op.count = count;
      op.op = ReduceOp::kSum;
      op.compression = compression;
      op.started = std::chrono::steady_clock::now();
      ctx.note_progress();
      ring_allreduce(ctx, workspace, op, path);
      double worst = 0;
      for (std::size_t i = 0; i < count; ++i) {
        worst = std::fmax(worst, std::fabs(double(data[i]) - double(expect[i])));
      }
      const double allowed = compression == Compression::kNone ? 0.0 : 0.5 * size * 6.0;
      EXPECT(worst <= allowed, "mixed ring, count %zu, %s: error %g", count,
             compression_name(compression), worst);
      EXPECT(same_on_all_ranks(data.data(), count * sizeof(float)),
             "mixed ring, count %zu, %s: ranks differ", count, compression_name(compression));
    }
  }
  std::vector<double> doubles(5000, rank + 1.0);
  Operation op;
  op.seq = seq++;
  op.data = doubles.data();
  op.count = doubles.size();
  op.dtype = DType::kFloat64;
  op.op = ReduceOp::kSum;
  op.started = std::chrono::steady_clock::now();
  ring_allreduce(ctx, workspace, op, path);
  const double want = size * (size + 1) / 2.0;
  EXPECT(doubles[0] == want && doubles.back() == want, "mixed ring float64 %g != %g",
         doubles[0], want);
  MPI_Barrier(MPI_COMM_WORLD);  // every rank is done with its neighbours' inboxes
  links.reset();
  ctx.close(true);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  {
    Engine engine(MPI_COMM_WORLD, 4096);  // small segments: many per chunk
    const std::size_t counts[] = {0, 1, static_cast<std::size_t>(size > 1 ? size - 1 : 1), 4, 1000, 10007, 70001};
    for (std::size_t count : counts) {
      check_float32(engine, count, Compression::kNone, rank);
      check_float32(engine, count, Compression::kTrunc16, rank);
      check_float32(engine, count, Compression::kQuant8, rank);
      check_half(engine, count, rank);
    }
    // Many operations in flight at once.
    std::vector<std::vector<double>> bufs(16, std::vector<double>(5000, rank + 1.0));
    std::vector<std::shared_ptr<Operation>> ops;
    for (auto& b : bufs) ops.push_back(engine.allreduce(b.data(), b.size(), DType::kFloat64, ReduceOp::kSum, Compression::kNone));
    for (auto& op : ops) op->wait(-1);
    const double want = size * (size + 1) / 2.0;
    for (auto& b : bufs) EXPECT(b[0] == want && b.back() == want, "async float64 %g != %g", b[0], want);
    engine.shutdown(-1);

    // Large operations are tried on the links, as messages and staged on the board
    // (path_tuner.h): every one exact and identical on all ranks, and all ranks keep the
    // same path.
    {
      Engine tuned(MPI_COMM_WORLD, 0);
      // 5 MiB and 7 elements: a staged operation's last piece is a short one.
      for (int i = 0; i < 12; ++i) check_float32(tuned, (5u << 20) / 4 + 7, Compression::kNone, rank);
      const auto decided = tuned.tuned_paths();
      if (tuned.uses_shm_links()) {
        EXPECT(decided.size() == 1 && decided.count(4u << 20) == 1, "the 4 MiB class is decided");
      } else {
        EXPECT(decided.empty(), "nothing is tuned without links");
      }
      const int mine = decided.empty() ? -1 : static_cast<int>(decided.begin()->second);
      EXPECT(same_on_all_ranks(&mine, sizeof mine), "ranks decided differently");
      tuned.shutdown(-1);
    }

    if (size > 1) check_mixed_ring(rank, size);

    // The engine's own buffers (shm_buffers.h), reduced in place on the board: exact,
    // identical on every rank, and a slice leaves the rest of the buffer alone.
    {
      Engine shared(MPI_COMM_WORLD, 0);
      for (const std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{70001}}) {
        auto buffer = shared.shared_buffer(count * sizeof(float));
        EXPECT((buffer != nullptr) == (size > 1 && shared.uses_shm_links()),
               "a shared buffer exists exactly where the ranks share links");
        if (buffer == nullptr) continue;
        auto* data = reinterpret_cast<float*>(buffer->mine());
        std::vector<float> expect(count);
        for (std::size_t i = 0; i < count; ++i) {
          data[i] = static_cast<float>((i * 5 + static_cast<std::size_t>(rank)) % 11) - 5.0f;
        }
        MPI_Allreduce(data, expect.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                      MPI_COMM_WORLD);
        // The whole buffer but its first element.
        auto op = shared.allreduce(data + 1, count - 1, DType::kFloat32, ReduceOp::kSum,
                                   Compression::kNone);
        op->wait(-1);
        EXPECT(op->status() == OpStatus::kDone, "shared buffer: %s", op->error().c_str());
        EXPECT(data[0] == static_cast<float>(rank % 11) - 5.0f, "the slice's outside changed");
        EXPECT(std::memcmp(data + 1, expect.data() + 1, (count - 1) * sizeof(float)) == 0,
               "shared buffer of %zu: not MPI's sums", count);
        EXPECT(same_on_all_ranks(data + 1, (count - 1) * sizeof(float)),
               "shared buffer of %zu: ranks differ", count);
      }
      shared.shutdown(-1);
    }

    // Mismatched counts fail on every rank instead of corrupting memory.
    if (size > 1) {
      Engine broken(MPI_COMM_WORLD, 4096);
      std::vector<float> buf(1000 + (rank == 1 ? 3 : 0), 1.0f);
      auto op = broken.allreduce(buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, Compression::kNone);
      EXPECT(op->wait(20.0), "mismatch did not fail within 20 s");
      EXPECT(op->failure() == FailureKind::kMismatch, "expected a mismatch, got %s", op->error().c_str());
      broken.shutdown(1.0);
    }
  }
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("test_ring: %d ranks, %d failures\n", size, total);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
