// The comparison macro of the host-only check programs (csrc/**/checks/*.cu, run by tests/test_device_checks.py):
// EXPECT_EQ counts mismatches in g_fail and prints the first 20 with where they were found. Not part of the module.
#pragma once

#include <cstdio>

static int g_fail = 0;
#define EXPECT_EQ(a, b, what, ...)                                              \
  do {                                                                          \
    long long va_ = (long long)(a), vb_ = (long long)(b);                       \
    if (va_ != vb_) {                                                           \
      if (g_fail < 20) {                                                        \
        printf("MISMATCH %s: got %lld expected %lld at ", what, va_, vb_);      \
        printf(__VA_ARGS__);                                                    \
        printf("\n");                                                           \
      }                                                                         \
      ++g_fail;                                                                 \
    }                                                                           \
  } while (0)
