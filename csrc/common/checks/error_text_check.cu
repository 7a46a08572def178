// Host-only check of common/check.h's error text (ErrorText, FMLA_HOST_CHECK): the values the checks print come
// out as expected. Needs no GPU:
//   nvcc -std=c++17 -I csrc csrc/common/checks/error_text_check.cu -o /tmp/error_text_check && /tmp/error_text_check
// tests/test_device_checks.py compiles and runs it.
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "common/check.h"

enum class Kind : int { kA = 7 };

static int g_fail = 0;

static void expect_message(const std::string& want, void (*fn)()) {
  try {
    fn();
    std::printf("no exception, expected \"%s\"\n", want.c_str());
    ++g_fail;
  } catch (const std::runtime_error& e) {
    const std::string got = e.what();
    if (got.rfind(want, 0) != 0) {
      std::printf("got \"%s\"\nwant a message starting with \"%s\"\n", got.c_str(), want.c_str());
      ++g_fail;
    }
  }
}

int main() {
  expect_message("flashmla_backend: ints 3 -4 5000000000 255 x=true", [] {
    const int64_t big = 5000000000LL;
    const uint8_t byte = 255;
    FMLA_HOST_CHECK(false, "ints " << 3 << " " << -4 << " " << big << " " << int(byte) << " " << 'x' << "=" << true);
  });
  expect_message("flashmla_backend: floats 0.25 1e+30 kind 7 s 'name'", [] {
    const std::string s = "name";
    FMLA_HOST_CHECK(1 + 1 == 3, "floats " << 0.25f << " " << 1e30 << " kind " << Kind::kA << " s '" << s << "'");
  });
  expect_message("flashmla_backend: address 0x40 null (null)", [] {
    const int32_t* p = reinterpret_cast<const int32_t*>(uintptr_t(64));
    const char* none = nullptr;
    FMLA_HOST_CHECK(p == nullptr, "address " << p << " null " << none);
  });
  // The text ends with the condition and the place.
  expect_message("flashmla_backend: tail [2 < 1 failed at ", [] { FMLA_HOST_CHECK(2 < 1, "tail"); });
  if (g_fail) {
    std::printf("%d mismatches\n", g_fail);
    return 1;
  }
  std::printf("error text: ok\n");
  return 0;
}
