// Private: SHA-256 and HMAC-SHA-256 (FIPS 180-4, RFC 2104), for the
// rendezvous' challenge-response (src/elastic/rdzv_auth.cpp). Small and
// dependency-free so the launcher links no crypto library; checked against
// the FIPS and RFC 4231 test vectors (tests/unit/rdzv_auth_test.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace dtrain::crypto {

using Digest = std::array<std::uint8_t, 32>;

Digest sha256(std::string_view data);
Digest hmac_sha256(std::string_view key, std::string_view message);
// Compares without an early exit, so timing does not tell how much matched.
bool equal_digests(const Digest& a, const Digest& b);

}  // namespace dtrain::crypto
