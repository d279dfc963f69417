#include "engine_config.h"

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

void check_range(const char* name, int value, int min_value, int max_value) {
  if (value < min_value || value > max_value) {
    throw std::invalid_argument(std::string(name) + "=" + std::to_string(value) +
                                " is not in [" + std::to_string(min_value) + ", " +
                                std::to_string(max_value) + "]");
  }
}

}  // namespace

EngineConfig read_env_config() {
  EngineConfig c;
  c.poll_us = static_cast<int>(env_double("PIPESGD_POLL_US", c.poll_us, 0));
  c.spin_us = static_cast<int>(env_double("PIPESGD_SPIN_US", c.spin_us, 0));
  // Unset keeps the default (-1, measure); a value given must be 0 or 1.
  c.shm_links = static_cast<int>(env_double("PIPESGD_SHM_LINKS", c.shm_links, 0, 1));
  c.stall_seconds = env_double("PIPESGD_STALL_SECONDS", c.stall_seconds, 0);
  c.shutdown_seconds = env_double("PIPESGD_SHUTDOWN_SECONDS", c.shutdown_seconds, 0);
  return c;
}

EngineConfig resolve_config(const EngineOptions& options) {
  check_range("window", options.window, 0, std::numeric_limits<int>::max());
  check_range("comm_nice", options.comm_nice, -20, 19);
  check_range("comm_slice_us", options.comm_slice_us, 0, std::numeric_limits<int>::max());
  check_range("poll_max_us", options.poll_max_us, 0, std::numeric_limits<int>::max());
  EngineConfig c = read_env_config();
  c.segment_bytes = options.segment_bytes;
  c.window = options.window;
  c.comm_nice = options.comm_nice;
  c.comm_slice_us = options.comm_slice_us;
  c.poll_max_us = std::max(options.poll_max_us, c.poll_us);  // a ceiling below the floor: no growth
  c.poll_while_waited = options.poll_while_waited ? 1 : 0;
  c.board_bytes = options.board_bytes;
  return c;
}

}  // namespace pipesgd
