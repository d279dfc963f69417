#include "allreduce/board.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "allreduce/elementwise.h"
#include "allreduce/ring_header.h"
#include "allreduce/ring_layout.h"

namespace pipesgd {
namespace {

static_assert(sizeof(RingHeader) <= ShmBoard::kNoteBytes, "a header fits a board note");

RingHeader board_header(const Operation& op, int rank) {
  return make_ring_header(op, rank, /*segment_elems=*/0);
}

[[noreturn]] void fail_mismatch(CommContext& ctx, const Operation& op, const RingHeader& mine,
                                const RingHeader& theirs, int rank, int peer) {
  const std::string message = ring_mismatch_message(mine, &theirs, rank, peer, "");
  ctx.broadcast_failure(op, message);
  throw OpFailure(FailureKind::kMismatch, message);
}

}  // namespace

void announce_operation(ShmBoard& board, const Operation& op) {
  const RingHeader header = board_header(op, board.rank());
  board.announce(&header, sizeof header);
}

bool board_takes(const ShmBoard& board, const Operation& op) {
  return op.compression == Compression::kNone &&
         (op.shared.buffer != nullptr || op.count * dtype_size(op.dtype) <= board.capacity());
}

namespace {

// Sums elements [begin, begin + len) of every rank's data, in rank order, and writes the
// sums into every rank's data: block by block through a buffer that stays in the core's
// cache, so each byte of memory is read once and written once.
void reduce_into_every_part(const Operation& op, int ranks, std::size_t begin, std::size_t len) {
  constexpr std::size_t kBlockBytes = 16 * 1024;
  // Allocated (not bytes on the stack, so that it may hold any dtype), once per thread
  // that runs operations: the comm thread, or a caller running its own.
  thread_local const std::unique_ptr<unsigned char, decltype(&std::free)> storage(
      static_cast<unsigned char*>(std::aligned_alloc(64, kBlockBytes)), &std::free);
  if (storage == nullptr) throw std::bad_alloc();
  unsigned char* block = storage.get();
  const std::size_t elem = dtype_size(op.dtype);
  const std::size_t per_block = kBlockBytes / elem;
  auto part = [&](int q, std::size_t at) {
    return op.shared.buffer->part(q) + op.shared.offset + at * elem;
  };
  for (std::size_t at = begin; at < begin + len; at += per_block) {
    const std::size_t n = std::min(per_block, begin + len - at);
    std::memcpy(block, part(0, at), n * elem);
    for (int q = 1; q < ranks; ++q) add_into(op.dtype, block, part(q, at), n);
    if (op.op == ReduceOp::kAverage) divide_by(op.dtype, block, n, ranks);
    for (int q = 0; q < ranks; ++q) std::memcpy(part(q, at), block, n * elem);
  }
}

}  // namespace

void board_allreduce(CommContext& ctx, ShmBoard& board, Operation& op, std::uint64_t round) {
  const int p = board.ranks();
  const int me = board.rank();
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  if (!board_takes(board, op)) {
    throw OpFailure(FailureKind::kInvalid,
                    op.describe() + " does not fit the board: uncompressed, at most " +
                        std::to_string(board.capacity()) + " bytes");
  }
  const RingHeader mine = board_header(op, me);
  // This rank's slot for the round last held round - 2, which every rank must have read.
  for (int q = 0; q < p; ++q) {
    if (q == me || round < 2) continue;
    ctx.wait_on_bell(board, [&] { return board.read_by(q) >= round - 1; }, op, q,
                     "waiting for the board's slot to be read");
  }
  // In a shared buffer the data stays where it is; the slot holds the header alone.
  const bool in_place = op.shared.buffer != nullptr;
  unsigned char* own = board.slot(me, round);
  std::memcpy(own, &mine, sizeof mine);
  if (!in_place && bytes > 0) std::memcpy(own + ShmBoard::kNoteBytes, op.data, bytes);
  board.post(round, op.seq, ShmBoard::Stage::kData);

  // Every other rank's contribution, or its announcement of another operation.
  for (int q = 0; q < p; ++q) {
    if (q == me) continue;
    RingHeader theirs{};
    ctx.wait_on_bell(
        board,
        [&] {
          if (board.posted(q, round, op.seq, ShmBoard::Stage::kData)) {
            std::memcpy(&theirs, board.slot(q, round), sizeof theirs);
            return true;
          }
          unsigned char note[ShmBoard::kNoteBytes];
          if (!board.read_note(q, note)) return false;
          std::memcpy(&theirs, note, sizeof theirs);
          return theirs.seq == op.seq && !ring_headers_match(mine, theirs);
        },
        op, q, "waiting for its contribution on the board");
    if (!ring_headers_match(mine, theirs)) fail_mismatch(ctx, op, mine, theirs, me, q);
  }

  const std::size_t elem = dtype_size(op.dtype);
  auto data = [&](int q) { return board.slot(q, round) + ShmBoard::kNoteBytes; };
  auto* out = static_cast<unsigned char*>(op.data);
  // This rank's chunk: rank 0's part, plus rank 1's, ...: the same additions in the same
  // order wherever it is summed. It goes back into this rank's slot for the others.
  const RingLayout layout(op.count, p, me, 1);
  const std::size_t begin = layout.chunk_begin(me) * elem;
  const std::size_t len = layout.chunk_len(me);
  if (in_place) {
    reduce_into_every_part(op, p, layout.chunk_begin(me), len);
  } else if (len > 0) {
    std::memcpy(out + begin, data(0) + begin, len * elem);
    for (int q = 1; q < p; ++q) add_into(op.dtype, out + begin, data(q) + begin, len);
    if (op.op == ReduceOp::kAverage) divide_by(op.dtype, out + begin, len, p);
    std::memcpy(data(me) + begin, out + begin, len * elem);
  }
  board.post(round, op.seq, ShmBoard::Stage::kReduced);
  // Every other rank's reduced chunk: copied byte for byte, or already written in place.
  for (int q = 0; q < p; ++q) {
    if (q == me) continue;
    ctx.wait_on_bell(
        board, [&] { return board.posted(q, round, op.seq, ShmBoard::Stage::kReduced); }, op,
        q, "waiting for its reduced chunk on the board");
    if (const std::size_t n = layout.chunk_len(q); n > 0 && !in_place) {
      const std::size_t chunk = layout.chunk_begin(q) * elem;
      std::memcpy(out + chunk, data(q) + chunk, n * elem);
    }
  }
  board.finish_reading(round + 1);
}

}  // namespace pipesgd
