// Ring AllReduce with segments pipelined across steps.
//
// Example, p = 3, rank 1 (left = 0, right = 2), chunks A B C:
//   reduce-scatter step 0: send B (own data), receive A from rank 0, A += mine
//   reduce-scatter step 1: send A (partial sum), receive C, C += mine -> C final
//   allgather step 0:      send C (final),  receive B (final, from rank 0)
//   allgather step 1:      send B,          receive A (final)
// Each element is summed in one fixed order along the ring and the final value
// is then copied byte for byte, so every rank ends bitwise identical.
//
// Pipelining: the segment received at step k is the one sent at step k + 1, so
// the send of segment s at step k + 1 is posted as soon as segment s of step k
// is reduced, while later segments are still arriving. `window` receives stay
// posted ahead of the one being reduced (staging slots), so transfer of the
// next segments overlaps the reduction of this one.
//
// Compression (trunc16, quant8; float32 only): reduce-scatter hops decompress
// what arrives, add local values and recompress for the next hop; the owner
// of a reduced chunk compresses it once, decompresses those same bytes for
// itself (one fused kernel for the three), and allgather forwards the bytes
// unchanged. Average divides once, at the end: by the owner before allgather
// when uncompressed, by every rank after decompressing the same bytes otherwise.
//
// Over shared-memory links (shm_links.h) the segments travel through the right
// neighbour's inbox instead of MPI messages: sends are queued in the order the
// right neighbour will take them (step by step, segment by segment, which is the
// order of its units) and copied out whenever it has a free slot, and each unit
// is processed straight out of this rank's inbox. The header still goes by MPI.
//
// Mismatch detection: each rank sends a small header (sequence number, count,
// dtype, op, compression) to its right neighbour alongside its first segments
// and posts no data receive before the left neighbour's header matches its
// own, so mismatched sizes can never corrupt memory. A mismatch is broadcast on
// the control channel so every rank fails, not just the two neighbours.
#include "allreduce/ring.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "allreduce/elementwise.h"
#include "allreduce/ring_layout.h"
#include "allreduce/wire_codec.h"
#include "mpi_check.h"

namespace pipesgd {
namespace {

constexpr std::uint64_t kHeaderMagic = 0x70697065736764ULL;  // "pipesgd"

struct Header {
  std::uint64_t magic;
  std::uint64_t seq;
  std::uint64_t count;
  std::int32_t dtype;
  std::int32_t op;
  std::int32_t compression;
  std::int32_t rank;
  std::uint64_t segment_elems;  // ranks must cut segments alike (segment_bytes)
};

Header make_header(const Operation& op, int rank, std::size_t segment_elems) {
  return Header{kHeaderMagic,
                op.seq,
                op.count,
                static_cast<std::int32_t>(op.dtype),
                static_cast<std::int32_t>(op.op),
                static_cast<std::int32_t>(op.compression),
                rank,
                segment_elems};
}

std::string header_shape(const Header& h) {
  return std::to_string(h.count) + " x " + dtype_name(static_cast<DType>(h.dtype)) + " (op " +
         reduce_op_name(static_cast<ReduceOp>(h.op)) + ", compression " +
         compression_name(static_cast<Compression>(h.compression)) + ", segments of " +
         std::to_string(h.segment_elems) + " elements)";
}

bool headers_match(const Header& a, const Header& b) {
  return a.magic == b.magic && a.seq == b.seq && a.count == b.count && a.dtype == b.dtype &&
         a.op == b.op && a.compression == b.compression && a.segment_elems == b.segment_elems;
}

constexpr std::size_t kAlign = 64;
// The step a header travels under on shared-memory links, ahead of the data.
constexpr int kHeaderStep = -1;
// Segments per ring step from which an operation streams (CommContext::set_streaming).
constexpr std::size_t kStreamingSegments = 4;
std::size_t round_up(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// One unit of receive work: segment `seg` of chunk `chunk` arriving at `step`.
struct Unit {
  int step;
  int chunk;
  std::size_t seg;
};

class RingRun {
 public:
  RingRun(CommContext& ctx, Workspace& ws, Operation& op, const RingPath& path)
      : ctx_(ctx),
        ws_(ws),
        op_(op),
        links_(path.links),
        p_(ctx.size()),
        rank_(ctx.rank()),
        left_((rank_ - 1 + p_) % p_),
        right_((rank_ + 1) % p_),
        elem_(dtype_size(op.dtype)),
        codec_(make_wire_codec(op.compression)),
        layout_(op.count, p_, rank_, std::max<std::size_t>(1, path.segment_bytes / elem_)),
        window_(std::max(1, path.window)) {}

  void run() {
    if (links_ != nullptr) {
      run_over_links();  // no MPI request is ever posted on this path
      return;
    }
    try {
      exchange_headers_and_start();
      receive_and_reduce();
      for (auto& per_chunk : rs_send_) sends_.insert(sends_.end(), per_chunk.begin(), per_chunk.end());
      rs_send_.clear();
      ctx_.wait_all(sends_, op_, right_, "waiting for the right neighbour to receive");
      ctx_.wait(header_send_, op_, right_, "header send");
    } catch (...) {
      ctx_.release_requests(recvs_, /*cancel=*/true);
      std::vector<MPI_Request> hr{header_recv_};
      ctx_.release_requests(hr, true);
      ctx_.release_requests(sends_, false);
      for (auto& per_chunk : rs_send_) ctx_.release_requests(per_chunk, false);
      std::vector<MPI_Request> hs{header_send_};
      ctx_.release_requests(hs, false);
      throw;
    }
  }

 private:
  unsigned char* local(std::size_t elem_offset) const {
    return static_cast<unsigned char*>(op_.data) + elem_offset * elem_;
  }
  float* local_f32(std::size_t elem_offset) const {
    return static_cast<float*>(op_.data) + elem_offset;
  }

  void prepare_buffers() {
    const std::size_t seg = layout_.max_segment_elems();
    const std::size_t slot_bytes = round_up(codec_ ? codec_->wire_bytes(seg) : seg * elem_);
    slot_stride_ = slot_bytes;
    // Over shared-memory links segments are processed in the inbox itself.
    if (links_ == nullptr) {
      slots_ = ws_.receive_slots(slot_bytes * static_cast<std::size_t>(window_));
    }
    if (!codec_) return;
    // One wire area per (chunk, segment): it holds what this rank sends for
    // that segment and, in allgather, the final bytes it receives and forwards.
    area_offset_.assign(static_cast<std::size_t>(p_), {});
    std::size_t total = 0;
    for (int c = 0; c < p_; ++c) {
      for (std::size_t s = 0; s < layout_.segments(c); ++s) {
        area_offset_[static_cast<std::size_t>(c)].push_back(total);
        total += round_up(codec_->wire_bytes(layout_.segment_len(c, s)));
      }
    }
    wire_ = ws_.wire(total);
    scratch_ = ws_.scratch(seg);
  }

  unsigned char* area(int c, std::size_t s) const {
    return wire_ + area_offset_[static_cast<std::size_t>(c)][s];
  }

  void exchange_headers_and_start() {
    mine_ = make_header(op_, rank_, layout_.max_segment_elems());
    PSG_MPI_CHECK(MPI_Irecv(&theirs_, sizeof(Header), MPI_BYTE, left_, ctx_.header_tag(op_.seq),
                            ctx_.comm(), &header_recv_),
                  left_);
    PSG_MPI_CHECK(MPI_Isend(&mine_, sizeof(Header), MPI_BYTE, right_, ctx_.header_tag(op_.seq),
                            ctx_.comm(), &header_send_),
                  right_);
    start_sends();
    // Step 0 sends this rank's own data; they need nothing from anyone, but
    // are released gradually (post_first_step_sends) so the right neighbour is
    // never flooded with segments it has not posted receives for yet.
    post_first_step_sends(static_cast<std::size_t>(window_));
    ctx_.wait(header_recv_, op_, left_, "waiting for the operation header",
              /*teaches_spin=*/false);
    check_headers(/*theirs_valid=*/true);
  }

  void start_sends() {
    prepare_buffers();
    if (links_ != nullptr) return;  // no MPI requests, no polling to tune
    ctx_.set_streaming(layout_.segments(0) >= kStreamingSegments);
    rs_send_.assign(static_cast<std::size_t>(p_), {});
    for (int c = 0; c < p_; ++c) {
      rs_send_[static_cast<std::size_t>(c)].assign(layout_.segments(c), MPI_REQUEST_NULL);
    }
  }

  // Where the MPI request of the send of segment (c, s) at `step` is kept; nullptr over
  // the links, which need none.
  MPI_Request* send_request(int step, int c, std::size_t s) {
    if (links_ != nullptr) return nullptr;
    if (layout_.is_reduce_scatter(step)) return &rs_send_[static_cast<std::size_t>(c)][s];
    sends_.push_back(MPI_REQUEST_NULL);
    return &sends_.back();
  }

  // Fails every rank unless the left neighbour's header matches this rank's own.
  void check_headers(bool theirs_valid) {
    if (theirs_valid && headers_match(mine_, theirs_)) return;
    const std::string message =
        "collective mismatch at " + std::string("allreduce #") + std::to_string(op_.seq) +
        ": rank " + std::to_string(rank_) + " submitted " + header_shape(mine_) +
        " but its left neighbour rank " + std::to_string(left_) + " submitted " +
        (theirs_valid && theirs_.magic == kHeaderMagic ? header_shape(theirs_)
                                                        : std::string("garbage")) +
        "; every rank must submit the same operations in the same order";
    ctx_.broadcast_failure(op_, message);
    throw OpFailure(FailureKind::kMismatch, message);
  }

  // Posts the step-0 sends of segments [first_step_posted_, limit). Eagerly sent
  // segments that arrive before their receive is posted queue up inside MPI as
  // unexpected messages (copied, and matched by a linear search), which made a
  // 64 MiB allreduce in 32 KiB segments 10x slower. Each rank releases its step-0
  // segment s only once it is about to process its own unit s - window; ranks run
  // in near lockstep, so the neighbour has that receive posted by then.
  void post_first_step_sends(std::size_t limit) {
    const int c0 = layout_.send_chunk(0);
    const std::size_t nseg = layout_.segments(c0);
    for (; first_step_posted_ < nseg && first_step_posted_ < limit; ++first_step_posted_) {
      const std::size_t s = first_step_posted_;
      const std::size_t off = layout_.segment_begin(c0, s);
      const std::size_t n = layout_.segment_len(c0, s);
      MPI_Request* req = send_request(0, c0, s);
      if (codec_) {
        codec_->encode(local_f32(off), n, area(c0, s));
        post_send(0, s, area(c0, s), codec_->wire_bytes(n), req);
      } else {
        post_send(0, s, local(off), n * elem_, req);
      }
    }
  }

  // Within a step, segments are sent and received in increasing order, and
  // MPI keeps messages of one (source, tag) in order, so the n-th receive of a
  // step matches the n-th send of that step.
  void post_send(int step, std::size_t seg, const void* buf, std::size_t bytes,
                 MPI_Request* req) {
    if (links_ != nullptr) {
      outbox_.push_back(Outgoing{step, seg, buf, bytes});
      return;
    }
    PSG_MPI_CHECK(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, right_,
                            ctx_.data_tag(op_.seq, step), ctx_.comm(), req),
                  right_);
  }

  void receive_and_reduce() {
    std::vector<Unit> units;
    for (int step = 0; step < layout_.steps(); ++step) {
      const int c = layout_.recv_chunk(step);
      for (std::size_t s = 0; s < layout_.segments(c); ++s) units.push_back(Unit{step, c, s});
    }
    recvs_.assign(static_cast<std::size_t>(window_), MPI_REQUEST_NULL);
    std::size_t posted = 0;
    const std::size_t window = static_cast<std::size_t>(window_);
    for (std::size_t u = 0; u < units.size(); ++u) {
      post_first_step_sends(u + window + 1);
      while (posted < units.size() && posted < u + window) {
        post_receive(units[posted], posted);
        ++posted;
      }
      const Unit& unit = units[u];
      const bool rs = layout_.is_reduce_scatter(unit.step);
      ctx_.wait(recvs_[u % recvs_.size()], op_, left_, rs ? "reduce-scatter" : "allgather");
      process(unit, slot(u));
    }
    post_first_step_sends(SIZE_MAX);  // a rank with nothing to receive still sends
  }

  unsigned char* slot(std::size_t u) const {
    return slots_ + (u % static_cast<std::size_t>(window_)) * slot_stride_;
  }

  void post_receive(const Unit& unit, std::size_t u) {
    const std::size_t off = layout_.segment_begin(unit.chunk, unit.seg);
    const std::size_t n = layout_.segment_len(unit.chunk, unit.seg);
    const std::size_t wire_n = codec_ ? codec_->wire_bytes(n) : n * elem_;
    unsigned char* dst = slot(u);
    if (!layout_.is_reduce_scatter(unit.step)) {
      // Allgather lands in the segment's final home, which this rank sent from
      // during reduce-scatter: that send must be complete first.
      MPI_Request& earlier = rs_send_[static_cast<std::size_t>(unit.chunk)][unit.seg];
      ctx_.wait(earlier, op_, right_, "reduce-scatter send before allgather overwrite");
      dst = codec_ ? area(unit.chunk, unit.seg) : local(off);
    }
    PSG_MPI_CHECK(MPI_Irecv(dst, static_cast<int>(wire_n), MPI_BYTE, left_,
                            ctx_.data_tag(op_.seq, unit.step), ctx_.comm(),
                            &recvs_[u % recvs_.size()]),
                  left_);
  }

  void process(const Unit& unit, const unsigned char* received) {
    const int c = unit.chunk;
    const std::size_t s = unit.seg;
    const std::size_t off = layout_.segment_begin(c, s);
    const std::size_t n = layout_.segment_len(c, s);
    const bool rs = layout_.is_reduce_scatter(unit.step);
    const bool final_rs = unit.step == p_ - 2;
    const bool average = op_.op == ReduceOp::kAverage;
    const bool forward = unit.step + 1 < layout_.steps();
    MPI_Request* next_req = forward ? send_request(unit.step + 1, c, s) : nullptr;
    if (!codec_) {
      if (rs) {
        add_into(op_.dtype, local(off), received, n);
        if (final_rs && average) divide_by(op_.dtype, local(off), n, p_);
      }
      if (forward) post_send(unit.step + 1, s, local(off), n * elem_, next_req);
      return;
    }
    unsigned char* out = area(c, s);
    // Every rank decodes the same wire bytes with the same factor: bitwise equal.
    const float factor = average ? 1.0f / static_cast<float>(p_) : 1.0f;
    if (rs && !final_rs) {
      codec_->decode_add_encode(received, local_f32(off), n, scratch_, out);
    } else if (rs) {
      codec_->decode_add_encode_decode(received, local_f32(off), n, factor, out);
    } else {
      codec_->decode(out, n, factor, local_f32(off));
    }
    if (forward) post_send(unit.step + 1, s, out, codec_->wire_bytes(n), next_req);
  }

  std::size_t unit_bytes(const Unit& unit) const {
    const std::size_t n = layout_.segment_len(unit.chunk, unit.seg);
    return codec_ ? codec_->wire_bytes(n) : n * elem_;
  }

  // Shared-memory links: the header, then the units, arrive in this rank's unit order
  // (see the top). Nothing is read out of the inbox before the header matched.
  void run_over_links() {
    mine_ = make_header(op_, rank_, layout_.max_segment_elems());
    start_sends();
    outbox_.push_back(Outgoing{kHeaderStep, 0, &mine_, sizeof(Header)});
    post_first_step_sends(SIZE_MAX);  // queued; copied out as the right neighbour has room
    wait_for_arrival("waiting for the operation header");
    const ShmMessage& first = *links_->peek();
    const bool is_header = first.step == kHeaderStep && first.bytes == sizeof(Header);
    if (is_header) std::memcpy(&theirs_, links_->peek_data(), sizeof(Header));
    check_headers(is_header);
    links_->release();
    for (int step = 0; step < layout_.steps(); ++step) {
      const int c = layout_.recv_chunk(step);
      const bool rs = layout_.is_reduce_scatter(step);
      for (std::size_t s = 0; s < layout_.segments(c); ++s) {
        const Unit unit{step, c, s};
        wait_for_arrival(rs ? "reduce-scatter" : "allgather");
        check_arrival(*links_->peek(), unit);
        const unsigned char* data = links_->peek_data();
        if (!rs) {
          // Allgather lands in the segment's final home (the wire area when compressed,
          // which process() decodes and forwards from).
          unsigned char* home = codec_ ? area(c, s) : local(layout_.segment_begin(c, s));
          std::memcpy(home, data, unit_bytes(unit));
        }
        process(unit, data);
        links_->release();
      }
    }
    ctx_.wait_on_link(
        *links_, [this] { return flush_outbox(), outbox_.empty(); }, op_, right_,
        "waiting for the right neighbour to take the last segments");
  }

  // Copies out what the right neighbour has room for until the left neighbour's next
  // message is in.
  void wait_for_arrival(const char* phase) {
    ctx_.wait_on_link(
        *links_, [this] { return flush_outbox(), links_->peek() != nullptr; }, op_, left_,
        phase);
  }

  // Copies queued sends into the right neighbour's free slots.
  void flush_outbox() {
    while (!outbox_.empty() && links_->can_send()) {
      const Outgoing& out = outbox_.front();
      if (out.bytes > links_->right_slot_bytes()) {
        throw OpFailure(FailureKind::kMismatch,
                        op_.describe() + ": a segment of " + std::to_string(out.bytes) +
                            " bytes does not fit rank " + std::to_string(right_) +
                            "'s shared-memory slots of " +
                            std::to_string(links_->right_slot_bytes()) +
                            " bytes; every rank must create its engine with the same segment_bytes");
      }
      ShmMessage message;
      message.seq = op_.seq;
      message.step = out.step;
      message.segment = out.seg;
      message.bytes = out.bytes;
      links_->send(message, out.data);
      outbox_.pop_front();
    }
  }

  // The headers matched, so a segment that is not the expected one is a defect in
  // the ring, not in the caller's submissions: fail loudly rather than add it.
  void check_arrival(const ShmMessage& m, const Unit& unit) const {
    if (m.seq == op_.seq && m.step == unit.step && m.segment == unit.seg &&
        m.bytes == unit_bytes(unit)) {
      return;
    }
    throw OpFailure(FailureKind::kMpi,
                    op_.describe() + " on rank " + std::to_string(rank_) + " expected step " +
                        std::to_string(unit.step) + " segment " + std::to_string(unit.seg) +
                        " (" + std::to_string(unit_bytes(unit)) + " bytes) from rank " +
                        std::to_string(left_) + " but found allreduce #" +
                        std::to_string(m.seq) + " step " + std::to_string(m.step) +
                        " segment " + std::to_string(m.segment) + " (" +
                        std::to_string(m.bytes) + " bytes) in its shared-memory inbox");
  }

  // A send queued for the shared-memory links.
  struct Outgoing {
    int step;
    std::size_t seg;
    const void* data;
    std::size_t bytes;
  };

  CommContext& ctx_;
  Workspace& ws_;
  Operation& op_;
  ShmLinks* const links_;  // nullptr: segments go by MPI
  std::deque<Outgoing> outbox_;
  const int p_;
  const int rank_;
  const int left_;
  const int right_;
  const std::size_t elem_;
  std::unique_ptr<WireCodec> codec_;
  RingLayout layout_;
  const int window_;

  Header mine_{};
  Header theirs_{};
  MPI_Request header_send_ = MPI_REQUEST_NULL;
  MPI_Request header_recv_ = MPI_REQUEST_NULL;
  std::vector<MPI_Request> recvs_;
  std::vector<std::vector<MPI_Request>> rs_send_;  // [chunk][segment], reduce-scatter sends
  std::vector<MPI_Request> sends_;                 // allgather sends
  std::size_t first_step_posted_ = 0;
  std::vector<std::vector<std::size_t>> area_offset_;
  unsigned char* slots_ = nullptr;
  std::size_t slot_stride_ = 0;
  unsigned char* wire_ = nullptr;
  float* scratch_ = nullptr;
};

}  // namespace

void ring_allreduce(CommContext& ctx, Workspace& ws, Operation& op, const RingPath& path) {
  if (op.compression != Compression::kNone && op.dtype != DType::kFloat32) {
    throw OpFailure(FailureKind::kInvalid, std::string("compression '") +
                                               compression_name(op.compression) +
                                               "' needs float32 data, got " + dtype_name(op.dtype));
  }
  // One rank: the sum is the data itself and the average divides by one.
  if (ctx.size() == 1) return;
  RingRun(ctx, ws, op, path).run();
}

}  // namespace pipesgd
