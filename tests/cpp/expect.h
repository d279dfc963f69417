// EXPECT for the single-process self-tests: a failed expectation is printed with its
// place and counted, and the test goes on, so one run lists every failure.
#pragma once

#include <cstdio>

namespace selftest {
inline int failures = 0;
}  // namespace selftest

#define EXPECT(cond, what)                                                  \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, what); \
      ++selftest::failures;                                                 \
    }                                                                       \
  } while (0)
