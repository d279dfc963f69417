#include "env.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

namespace pipesgd {
namespace {

double env_double(const char* name, double fallback, double min_value,
                  double max_value = std::numeric_limits<double>::infinity()) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(value >= min_value) || value > max_value) {
    std::string range = ">= " + std::to_string(min_value);
    if (max_value < std::numeric_limits<double>::infinity()) {
      range = "in [" + std::to_string(min_value) + ", " + std::to_string(max_value) + "]";
    }
    throw std::invalid_argument(std::string(name) + "='" + text + "' is not a number " + range);
  }
  return value;
}

}  // namespace

EnvConfig read_env_config() {
  EnvConfig c;
  c.segment_bytes = static_cast<std::size_t>(
      env_double("PIPESGD_SEGMENT_BYTES", static_cast<double>(c.segment_bytes), 0));
  c.window = static_cast<int>(env_double("PIPESGD_RING_WINDOW", c.window, 1));
  c.poll_us = static_cast<int>(env_double("PIPESGD_POLL_US", c.poll_us, 0));
  c.poll_max_us = static_cast<int>(env_double("PIPESGD_POLL_MAX_US", c.poll_max_us, 0));
  c.poll_max_us = std::max(c.poll_max_us, c.poll_us);  // a ceiling below the floor: no growth
  c.spin_us = static_cast<int>(env_double("PIPESGD_SPIN_US", c.spin_us, 0));
  c.poll_while_waited =
      static_cast<int>(env_double("PIPESGD_POLL_WHILE_WAITED", c.poll_while_waited, 0));
  // Unset keeps the default (-1, measure); a value given must be 0 or 1.
  c.shm_links = static_cast<int>(env_double("PIPESGD_SHM_LINKS", c.shm_links, 0, 1));
  c.comm_slice_us = static_cast<int>(env_double("PIPESGD_COMM_SLICE_US", c.comm_slice_us, 0));
  c.comm_nice = static_cast<int>(env_double("PIPESGD_COMM_NICE", c.comm_nice, -20, 19));
  c.stall_seconds = env_double("PIPESGD_STALL_SECONDS", c.stall_seconds, 0);
  c.shutdown_seconds = env_double("PIPESGD_SHUTDOWN_SECONDS", c.shutdown_seconds, 0);
  return c;
}

}  // namespace pipesgd
