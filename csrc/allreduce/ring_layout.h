// Which elements travel at each ring step.
//
// The buffer of `count` elements is cut into p chunks. Leftover elements
// (count % p) are handed out one by one to the first chunks, so chunk sizes
// differ by at most one and a chunk may be empty when count < p. Each chunk is
// cut into segments of at most `segment_elems` elements: a segment is one
// message, the unit whose transfer overlaps the reduction of the previous one.
//
// Rank r, with p ranks and S = p - 1:
//   reduce-scatter step i (0 <= i < S):  send chunk (r - i), receive chunk (r - i - 1)
//   allgather step j      (0 <= j < S):  send chunk (r + 1 - j), receive chunk (r - j)
// all mod p. After reduce-scatter rank r owns the fully reduced chunk (r + 1);
// the chunk received at step k is exactly the one sent at step k + 1.
#pragma once

#include <cstddef>

namespace pipesgd {

class RingLayout {
 public:
  RingLayout(std::size_t count, int size, int rank, std::size_t segment_elems)
      : count_(count), p_(size), r_(rank), seg_(segment_elems == 0 ? 1 : segment_elems) {}

  int size() const { return p_; }
  int steps() const { return 2 * (p_ - 1); }
  bool is_reduce_scatter(int step) const { return step < p_ - 1; }

  std::size_t chunk_begin(int c) const {
    const std::size_t base = count_ / static_cast<std::size_t>(p_);
    const std::size_t extra = count_ % static_cast<std::size_t>(p_);
    const std::size_t uc = static_cast<std::size_t>(c);
    return uc * base + (uc < extra ? uc : extra);
  }
  std::size_t chunk_len(int c) const {
    const std::size_t base = count_ / static_cast<std::size_t>(p_);
    const std::size_t extra = count_ % static_cast<std::size_t>(p_);
    return base + (static_cast<std::size_t>(c) < extra ? 1 : 0);
  }
  std::size_t segments(int c) const { return (chunk_len(c) + seg_ - 1) / seg_; }
  // Absolute element offset and length of segment s of chunk c.
  std::size_t segment_begin(int c, std::size_t s) const { return chunk_begin(c) + s * seg_; }
  std::size_t segment_len(int c, std::size_t s) const {
    const std::size_t len = chunk_len(c);
    const std::size_t off = s * seg_;
    return len - off < seg_ ? len - off : seg_;
  }
  std::size_t max_segment_elems() const { return seg_; }

  int send_chunk(int step) const {
    return is_reduce_scatter(step) ? mod(r_ - step) : mod(r_ + 1 - (step - (p_ - 1)));
  }
  int recv_chunk(int step) const {
    return is_reduce_scatter(step) ? mod(r_ - step - 1) : mod(r_ - (step - (p_ - 1)));
  }
  int owned_chunk() const { return mod(r_ + 1); }

 private:
  int mod(int x) const { return ((x % p_) + p_) % p_; }

  std::size_t count_;
  int p_;
  int r_;
  std::size_t seg_;
};

}  // namespace pipesgd
