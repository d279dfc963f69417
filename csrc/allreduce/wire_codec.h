// How float32 segments look on the wire when the ring compresses them.
// Thin adapters over csrc/compress/kernels.h so the ring names one interface.
#pragma once

#include <cstddef>
#include <memory>

#include "dtype.h"

namespace pipesgd {

class WireCodec {
 public:
  virtual ~WireCodec() = default;
  virtual std::size_t wire_bytes(std::size_t n) const = 0;
  virtual void encode(const float* x, std::size_t n, void* wire) const = 0;
  // out = decode(wire) * factor
  virtual void decode(const void* wire, std::size_t n, float factor, float* out) const = 0;
  // out_wire = encode(decode(in_wire) + local)
  virtual void decode_add_encode(const void* in_wire, const float* local, std::size_t n,
                                 float* scratch, void* out_wire) const = 0;
  // The owner's last hop: out_wire = encode(decode(in_wire) + local), then
  // local = decode(out_wire) * factor, in one fused kernel.
  virtual void decode_add_encode_decode(const void* in_wire, float* local, std::size_t n,
                                        float factor, void* out_wire) const = 0;
};

// nullptr for Compression::kNone: the ring then sends the local dtype as is.
std::unique_ptr<WireCodec> make_wire_codec(Compression c);

}  // namespace pipesgd
