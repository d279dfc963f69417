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
// is reduced, while later segments are still arriving. `window` units are expected
// ahead of the one being reduced, so transfer of the next segments overlaps the
// reduction of this one.
//
// Compression (trunc16, quant8; float32 only): reduce-scatter hops decompress
// what arrives, add local values and recompress for the next hop; the owner
// of a reduced chunk compresses it once, decompresses those same bytes for
// itself (one fused kernel for the three), and allgather forwards the bytes
// unchanged. Average divides once, at the end: by the owner before allgather
// when uncompressed, by every rank after decompressing the same bytes otherwise.
//
// Each edge is MPI messages or a shared-memory link (ring_links.h); this loop does not
// know which. Mismatch detection: each rank sends a small header (ring_header.h) to its
// right neighbour ahead of its first segments and reads no segment before the left
// neighbour's header matches its own, so mismatched sizes can never corrupt memory. A
// mismatch is broadcast on the control channel so every rank fails, not just the two
// neighbours.
#include "allreduce/ring.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "allreduce/elementwise.h"
#include "allreduce/ring_header.h"
#include "allreduce/ring_layout.h"
#include "allreduce/ring_links.h"
#include "allreduce/wire_codec.h"

namespace pipesgd {
namespace {

constexpr std::size_t kAlign = 64;
// Segments per ring step from which an operation streams (CommContext::set_streaming).
constexpr std::size_t kStreamingSegments = 4;
std::size_t round_up(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

class RingRun {
 public:
  RingRun(CommContext& ctx, Workspace& ws, Operation& op, const RingPath& path)
      : ctx_(ctx),
        ws_(ws),
        op_(op),
        p_(ctx.size()),
        rank_(ctx.rank()),
        left_((rank_ - 1 + p_) % p_),
        right_((rank_ + 1) % p_),
        elem_(dtype_size(op.dtype)),
        codec_(make_wire_codec(op.compression)),
        layout_(op.count, p_, rank_, std::max<std::size_t>(1, path.segment_bytes / elem_)),
        window_(std::max(1, path.window)) {
    ShmLinks* links = path.links;
    const bool shm_out = links != nullptr && links->reaches_right();
    const bool shm_in = links != nullptr && links->reaches_left();
    prepare_buffers();
    out_ = shm_out ? shm_ring_out(*links, op, right_, layout_)
                   : mpi_ring_out(ctx, op, right_, layout_);
    in_ = shm_in ? shm_ring_in(*links, op, rank_, left_)
                 : mpi_ring_in(ctx, op, left_, ws, slot_bytes_, window_);
    both_links_ = shm_out && shm_in ? links : nullptr;
    // MPI's waits poll; how long they may sleep depends on how many segments stream.
    if (!(shm_out && shm_in)) ctx.set_streaming(layout_.segments(0) >= kStreamingSegments);
  }

  void run() {
    try {
      const RingHeader mine = make_ring_header(op_, rank_, layout_.max_segment_elems());
      out_->send_header(mine);
      in_->expect_header();
      // Step 0 sends this rank's own data; they need nothing from anyone.
      release_first_step(static_cast<std::size_t>(window_));
      wait([this] { return in_->header_arrived(); }, left_, "waiting for the operation header",
           /*teaches_spin=*/false);
      check_header(mine, in_->take_header());
      receive_and_reduce();
      wait([this] { return out_->progress(); }, right_,
           "waiting for the right neighbour to receive");
    } catch (...) {
      out_->abandon();
      in_->abandon();
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
  std::size_t wire_bytes(std::size_t n) const { return codec_ ? codec_->wire_bytes(n) : n * elem_; }

  void prepare_buffers() {
    const std::size_t seg = layout_.max_segment_elems();
    slot_bytes_ = round_up(wire_bytes(seg));
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

  // Polls `ready` until true, moving this rank's sends on meanwhile (the right neighbour
  // may be waiting for them): on the doorbell of the shared-memory links when both edges
  // are links, politely otherwise.
  void wait(const std::function<bool()>& ready, int peer, const char* phase,
            bool teaches_spin = true) {
    auto moving = [&] {
      out_->progress();
      return ready();
    };
    if (both_links_ != nullptr) {
      ctx_.wait_on_bell(*both_links_, moving, op_, peer, phase);
    } else {
      ctx_.wait_until(moving, op_, peer, phase, teaches_spin);
    }
  }

  // Fails every rank unless the left neighbour's header matches this rank's own.
  void check_header(const RingHeader& mine, const RingHeader* theirs) {
    if (theirs != nullptr && ring_headers_match(mine, *theirs)) return;
    const std::string message = ring_mismatch_message(mine, theirs, rank_, left_);
    ctx_.broadcast_failure(op_, message);
    throw OpFailure(FailureKind::kMismatch, message);
  }

  // Sends the step-0 segments [first_step_sent_, limit). Over MPI, eagerly sent
  // segments that arrive before their receive is posted queue up inside MPI as
  // unexpected messages (copied, and matched by a linear search), which made a
  // 64 MiB allreduce in 32 KiB segments 10x slower. So each rank releases its step-0
  // segment s only once it is about to process its own unit s - window; ranks run
  // in near lockstep, so the neighbour has that receive posted by then.
  void release_first_step(std::size_t limit) {
    if (!out_->throttles_first_step()) limit = SIZE_MAX;
    const int c0 = layout_.send_chunk(0);
    const std::size_t nseg = layout_.segments(c0);
    for (; first_step_sent_ < nseg && first_step_sent_ < limit; ++first_step_sent_) {
      const std::size_t s = first_step_sent_;
      const std::size_t off = layout_.segment_begin(c0, s);
      const std::size_t n = layout_.segment_len(c0, s);
      if (codec_) {
        codec_->encode(local_f32(off), n, area(c0, s));
        out_->send(0, c0, s, area(c0, s), codec_->wire_bytes(n));
      } else {
        out_->send(0, c0, s, local(off), n * elem_);
      }
    }
  }

  // Allgather lands in the segment's final home (the wire area when compressed, which
  // process() decodes and forwards from); nullptr for reduce-scatter.
  unsigned char* home(const RingUnit& unit) const {
    if (layout_.is_reduce_scatter(unit.step)) return nullptr;
    return codec_ ? area(unit.chunk, unit.seg)
                  : local(layout_.segment_begin(unit.chunk, unit.seg));
  }

  // The home was the buffer of this rank's reduce-scatter send of the same segment:
  // that send must be complete before anything lands there.
  void free_home(const RingUnit& unit) {
    wait([&] { return out_->sent(unit.chunk, unit.seg); }, right_,
         "reduce-scatter send before allgather overwrite");
  }

  void receive_and_reduce() {
    std::vector<RingUnit> units;
    for (int step = 0; step < layout_.steps(); ++step) {
      const int c = layout_.recv_chunk(step);
      for (std::size_t s = 0; s < layout_.segments(c); ++s) {
        units.push_back(RingUnit{step, c, s, wire_bytes(layout_.segment_len(c, s))});
      }
    }
    const std::size_t window = static_cast<std::size_t>(window_);
    std::size_t expected = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      release_first_step(u + window + 1);
      for (; expected < units.size() && expected < u + window; ++expected) {
        const RingUnit& next = units[expected];
        unsigned char* dst = home(next);
        if (dst != nullptr && in_->lands_when_expected()) free_home(next);
        in_->expect(expected, next, dst);
      }
      const RingUnit& unit = units[u];
      wait([&] { return in_->arrived(u); }, left_,
           layout_.is_reduce_scatter(unit.step) ? "reduce-scatter" : "allgather");
      unsigned char* dst = home(unit);
      if (dst != nullptr && !in_->lands_when_expected()) free_home(unit);
      process(unit, in_->take(u, unit, dst));
      in_->release();
    }
    release_first_step(SIZE_MAX);  // a rank with nothing to receive still sends
  }

  void process(const RingUnit& unit, const unsigned char* received) {
    const int c = unit.chunk;
    const std::size_t s = unit.seg;
    const std::size_t off = layout_.segment_begin(c, s);
    const std::size_t n = layout_.segment_len(c, s);
    const bool rs = layout_.is_reduce_scatter(unit.step);
    const bool final_rs = unit.step == p_ - 2;
    const bool average = op_.op == ReduceOp::kAverage;
    const bool forward = unit.step + 1 < layout_.steps();
    if (!codec_) {
      if (rs) {
        add_into(op_.dtype, local(off), received, n);
        if (final_rs && average) divide_by(op_.dtype, local(off), n, p_);
      }
      if (forward) out_->send(unit.step + 1, c, s, local(off), n * elem_);
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
    if (forward) out_->send(unit.step + 1, c, s, out, codec_->wire_bytes(n));
  }

  CommContext& ctx_;
  Workspace& ws_;
  Operation& op_;
  const int p_;
  const int rank_;
  const int left_;
  const int right_;
  const std::size_t elem_;
  std::unique_ptr<WireCodec> codec_;
  RingLayout layout_;
  const int window_;
  std::unique_ptr<RingOut> out_;
  std::unique_ptr<RingIn> in_;
  ShmLinks* both_links_ = nullptr;  // both edges are links: wait on their doorbell

  std::size_t first_step_sent_ = 0;
  std::vector<std::vector<std::size_t>> area_offset_;
  std::size_t slot_bytes_ = 0;
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
