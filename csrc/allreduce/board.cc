#include "allreduce/board.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
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

// Sums elements [begin, begin + len) of every rank's part of `buffer` (from byte
// `offset`), in rank order, and writes the sums into every rank's part: block by block
// through a buffer that stays in the core's cache, so each byte of memory is read once
// and written once. With `own_out`, this rank's (`me`) sums go there instead of into its
// own part (staging: straight into the caller's array, which its part would only have
// been copied back to).
void reduce_into_every_part(const SharedBuffer& buffer, std::size_t offset, DType dtype,
                            ReduceOp op, int ranks, std::size_t begin, std::size_t len,
                            int me = -1, unsigned char* own_out = nullptr) {
  constexpr std::size_t kBlockBytes = 16 * 1024;
  // Allocated (not bytes on the stack, so that it may hold any dtype), once per thread
  // that runs operations: the comm thread, or a caller running its own.
  thread_local const std::unique_ptr<unsigned char, decltype(&std::free)> storage(
      static_cast<unsigned char*>(std::aligned_alloc(64, kBlockBytes)), &std::free);
  if (storage == nullptr) throw std::bad_alloc();
  unsigned char* block = storage.get();
  const std::size_t elem = dtype_size(dtype);
  const std::size_t per_block = kBlockBytes / elem;
  auto part = [&](int q, std::size_t at) { return buffer.part(q) + offset + at * elem; };
  for (std::size_t at = begin; at < begin + len; at += per_block) {
    const std::size_t n = std::min(per_block, begin + len - at);
    std::memcpy(block, part(0, at), n * elem);
    for (int q = 1; q < ranks; ++q) add_into(dtype, block, part(q, at), n);
    if (op == ReduceOp::kAverage) divide_by(dtype, block, n, ranks);
    for (int q = 0; q < ranks; ++q) {
      unsigned char* out = q == me && own_out != nullptr ? own_out + (at - begin) * elem
                                                         : part(q, at);
      std::memcpy(out, block, n * elem);
    }
  }
}

// What one round of the board reduces: `count` elements of `op`'s type, in place in
// `shared`'s parts from byte `offset` when `shared` is set, else copied through the
// slots from `data`. `staged_to`: `shared` is the stage and this rank's summed chunk goes
// to the caller's array at this address (the piece's first element), not to its part.
struct RoundData {
  std::size_t count = 0;
  unsigned char* data = nullptr;
  const SharedBuffer* shared = nullptr;
  std::size_t offset = 0;
  unsigned char* staged_to = nullptr;
};

// One round: post, wait for every rank's post of the same operation, sum this rank's
// chunk, post it, wait for every other chunk. `mine` is the whole operation's header,
// the same in each of its rounds.
void board_round(CommContext& ctx, ShmBoard& board, Operation& op, const RingHeader& mine,
                 std::uint64_t round, const RoundData& d) {
  const int p = board.ranks();
  const int me = board.rank();
  const std::size_t elem = dtype_size(op.dtype);
  // This rank's slot for the round last held round - 2, which every rank must have read.
  for (int q = 0; q < p; ++q) {
    if (q == me || round < 2) continue;
    ctx.wait_on_bell(board, [&] { return board.read_by(q) >= round - 1; }, op, q,
                     "waiting for the board's slot to be read");
  }
  // In a shared buffer the data stays where it is; the slot holds the header alone.
  const bool in_place = d.shared != nullptr;
  unsigned char* own = board.slot(me, round);
  std::memcpy(own, &mine, sizeof mine);
  if (!in_place && d.count > 0) std::memcpy(own + ShmBoard::kNoteBytes, d.data, d.count * elem);
  board.post(round, ShmBoard::Stage::kData);

  // Every other rank's contribution, or its announcement of another operation.
  for (int q = 0; q < p; ++q) {
    if (q == me) continue;
    RingHeader theirs{};
    ctx.wait_on_bell(
        board,
        [&] {
          if (board.posted(q, round, ShmBoard::Stage::kData)) {
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

  auto slot_data = [&](int q) { return board.slot(q, round) + ShmBoard::kNoteBytes; };
  // This rank's chunk: rank 0's part, plus rank 1's, ...: the same additions in the same
  // order wherever it is summed. It goes back into this rank's slot for the others.
  const RingLayout layout(d.count, p, me, 1);
  const std::size_t begin = layout.chunk_begin(me) * elem;
  const std::size_t len = layout.chunk_len(me);
  if (in_place) {
    reduce_into_every_part(*d.shared, d.offset, op.dtype, op.op, p, layout.chunk_begin(me), len,
                           me, d.staged_to != nullptr ? d.staged_to + begin : nullptr);
  } else if (len > 0) {
    std::memcpy(d.data + begin, slot_data(0) + begin, len * elem);
    for (int q = 1; q < p; ++q) add_into(op.dtype, d.data + begin, slot_data(q) + begin, len);
    if (op.op == ReduceOp::kAverage) divide_by(op.dtype, d.data + begin, len, p);
    std::memcpy(slot_data(me) + begin, d.data + begin, len * elem);
  }
  board.post(round, ShmBoard::Stage::kReduced);
  // Every other rank's reduced chunk, as soon as it is posted: copied byte for byte from
  // its slot, or, staged, back from this rank's part of the stage; in place already
  // written.
  for (int q = 0; q < p; ++q) {
    if (q == me) continue;
    ctx.wait_on_bell(
        board, [&] { return board.posted(q, round, ShmBoard::Stage::kReduced); }, op, q,
        "waiting for its reduced chunk on the board");
    const std::size_t n = layout.chunk_len(q);
    const std::size_t chunk = layout.chunk_begin(q) * elem;
    if (n > 0 && !in_place) {
      std::memcpy(d.data + chunk, slot_data(q) + chunk, n * elem);
    } else if (n > 0 && d.staged_to != nullptr) {
      std::memcpy(d.staged_to + chunk, d.shared->mine() + d.offset + chunk, n * elem);
    }
  }
  board.finish_reading(round + 1);
}

}  // namespace

void board_allreduce(CommContext& ctx, ShmBoard& board, Operation& op, std::uint64_t& rounds) {
  if (!board_takes(board, op)) {
    throw OpFailure(FailureKind::kInvalid,
                    op.describe() + " does not fit the board: uncompressed, at most " +
                        std::to_string(board.capacity()) + " bytes");
  }
  RoundData d;
  d.count = op.count;
  d.data = static_cast<unsigned char*>(op.data);
  d.shared = op.shared.buffer.get();
  d.offset = op.shared.offset;
  board_round(ctx, board, op, board_header(op, board.rank()), rounds++, d);
}

void staged_board_allreduce(CommContext& ctx, ShmBoard& board, const SharedBuffer& stage,
                            Operation& op, std::uint64_t& rounds) {
  if (op.compression != Compression::kNone || op.shared.buffer != nullptr) {
    throw OpFailure(FailureKind::kInvalid,
                    op.describe() + " cannot be staged: uncompressed, in the caller's memory");
  }
  const RingHeader mine = board_header(op, board.rank());
  const std::size_t elem = dtype_size(op.dtype);
  const std::size_t per_piece = stage.part_bytes() / elem;
  if (per_piece == 0) throw std::logic_error("the board's stage holds no element");
  auto* data = static_cast<unsigned char*>(op.data);
  RoundData d;
  d.shared = &stage;
  // Piece by piece: into this rank's part of the stage, reduced in place there, and back
  // (`staged_to`: this rank's chunk summed straight into the piece, the others copied from
  // its part as their owners post them). Every rank cuts the same pieces (the same count,
  // the same stage), and the stage's part is free again once every rank has posted its
  // reduced chunk of the last piece.
  std::size_t at = 0;
  do {  // once at least: an empty operation still meets its peers
    d.count = std::min(per_piece, op.count - at);
    unsigned char* piece = data + at * elem;
    d.staged_to = piece;
    if (d.count > 0) std::memcpy(stage.mine(), piece, d.count * elem);
    board_round(ctx, board, op, mine, rounds++, d);
    at += d.count;
  } while (at < op.count);
}

}  // namespace pipesgd
