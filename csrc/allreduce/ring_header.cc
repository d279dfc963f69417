#include "allreduce/ring_header.h"

#include "dtype.h"

namespace pipesgd {
namespace {

constexpr std::uint64_t kHeaderMagic = 0x70697065736764ULL;  // "pipesgd"

std::string shape(const RingHeader& h) {
  const std::string segments =
      h.segment_elems == 0 ? "" : ", segments of " + std::to_string(h.segment_elems) + " elements";
  const std::string place =
      h.shared_id == 0 ? ""
                       : ", in shared buffer #" + std::to_string(h.shared_id - 1) + " at byte " +
                             std::to_string(h.shared_offset);
  return std::to_string(h.count) + " x " + dtype_name(static_cast<DType>(h.dtype)) + " (op " +
         reduce_op_name(static_cast<ReduceOp>(h.op)) + ", compression " +
         compression_name(static_cast<Compression>(h.compression)) + segments + place + ")";
}

}  // namespace

RingHeader make_ring_header(const Operation& op, int rank, std::size_t segment_elems) {
  return RingHeader{kHeaderMagic,
                    op.seq,
                    op.count,
                    static_cast<std::int32_t>(op.dtype),
                    static_cast<std::int32_t>(op.op),
                    static_cast<std::int32_t>(op.compression),
                    rank,
                    segment_elems,
                    op.shared.buffer ? op.shared.buffer->id() + 1 : 0,
                    op.shared.offset};
}

bool ring_headers_match(const RingHeader& a, const RingHeader& b) {
  return a.magic == b.magic && a.seq == b.seq && a.count == b.count && a.dtype == b.dtype &&
         a.op == b.op && a.compression == b.compression && a.segment_elems == b.segment_elems &&
         a.shared_id == b.shared_id && a.shared_offset == b.shared_offset;
}

std::string ring_mismatch_message(const RingHeader& mine, const RingHeader* theirs, int rank,
                                  int peer, const char* relation) {
  return "collective mismatch at allreduce #" + std::to_string(mine.seq) + ": rank " +
         std::to_string(rank) + " submitted " + shape(mine) + " but " + relation + "rank " +
         std::to_string(peer) + " submitted " +
         (theirs != nullptr && theirs->magic == kHeaderMagic ? shape(*theirs)
                                                             : std::string("garbage")) +
         "; every rank must submit the same operations in the same order";
}

}  // namespace pipesgd
