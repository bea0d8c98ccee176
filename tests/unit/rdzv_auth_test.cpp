// The rendezvous' shared-secret authentication (Note [Rendezvous
// authentication] in src/elastic/rdzv_auth.cpp): SHA-256/HMAC against the
// published vectors, the handshake both ways, and a hosted rendezvous store
// that refuses a wrong secret, no secret and a plain c10d client, whose
// writes never reach it.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "../../src/core/hmac.h"
#include "../../src/elastic/rdzv_auth.h"
#include "dtrain/comm/store.h"
#include "dtrain/elastic/rendezvous.h"
#include "dtrain/error.h"
#include "ranks.h"

namespace {
namespace auth = dtrain::elastic::auth;
using dtrain::ConfigError;
using dtrain::testing::free_port;

std::string hex(const dtrain::crypto::Digest& d) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (auto b : d) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

// Runs the server side of a handshake on one end of a socket pair and the
// client side on the other; returns (server accepted, client's error or "").
std::pair<bool, std::string> handshake(const std::string& server_secret, const std::string& client_secret) {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  bool accepted = false;
  std::thread server([&] { accepted = auth::detail::server_handshake(fds[0], server_secret); });
  std::string error;
  try {
    auth::detail::client_handshake(fds[1], client_secret, "test");
  } catch (const ConfigError& e) {
    error = e.what();
    ::shutdown(fds[1], SHUT_RDWR);
  }
  server.join();
  ::close(fds[0]);
  ::close(fds[1]);
  return {accepted, error};
}

const std::string kSecret = "0123456789abcdef-job-secret";
}  // namespace

TEST(RdzvAuth, Sha256AndHmacMatchPublishedVectors) {
  using dtrain::crypto::hmac_sha256;
  using dtrain::crypto::sha256;
  EXPECT_EQ(hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex(sha256(std::string(1000000, 'a'))), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // RFC 4231 cases 1, 2 and 6 (a key longer than the block).
  EXPECT_EQ(hex(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hex(hmac_sha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(RdzvAuth, HandshakeAcceptsTheSecretAndRefusesAnother) {
  auto [accepted, error] = handshake(kSecret, kSecret);
  EXPECT_TRUE(accepted);
  EXPECT_EQ(error, "");
  std::tie(accepted, error) = handshake(kSecret, kSecret + "x");
  EXPECT_FALSE(accepted);
  EXPECT_NE(error.find("refused this node: its secret does not match"), std::string::npos) << error;
}

TEST(RdzvAuth, GarbageAndSilenceAreRefused) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const std::string junk(64, 'x');  // e.g. a c10d client's first message
  ASSERT_EQ(::write(fds[1], junk.data(), junk.size()), 64);
  EXPECT_FALSE(auth::detail::server_handshake(fds[0], kSecret));
  ::close(fds[0]);
  ::close(fds[1]);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::shutdown(fds[1], SHUT_WR);  // says nothing
  EXPECT_FALSE(auth::detail::server_handshake(fds[0], kSecret));
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(RdzvAuth, SecretFromFileOrEnvironment) {
  const auto file = std::filesystem::temp_directory_path() / ("dtrain-secret-" + std::to_string(::getpid()));
  std::ofstream(file) << kSecret << "\n";
  EXPECT_EQ(auth::read_secret(file.string()), kSecret);  // the trailing newline is dropped
  std::ofstream(file) << "short";
  EXPECT_THROW(auth::read_secret(file.string()), ConfigError);
  std::ofstream(file) << "";
  EXPECT_THROW(auth::read_secret(file.string()), ConfigError);
  EXPECT_THROW(auth::read_secret("/no/such/secret"), ConfigError);
  std::filesystem::remove(file);
  ::setenv("DTRAIN_RDZV_SECRET", kSecret.c_str(), 1);
  EXPECT_EQ(auth::read_secret(""), kSecret);
  ::unsetenv("DTRAIN_RDZV_SECRET");
  EXPECT_EQ(auth::read_secret(""), "");
}

// A hosted store behind the gate: a node with the secret reads and writes
// it; a wrong secret, no secret, and c10d's own client are refused, and
// nothing they try reaches the store.
TEST(RdzvAuth, HostedStoreAdmitsOnlyTheSecret) {
  using dtrain::elastic::connect_tcp_rendezvous_store;
  const int port = free_port();
  const auto timeout = std::chrono::seconds(5);
  auto host = connect_tcp_rendezvous_store("127.0.0.1", port, timeout, kSecret);
  ASSERT_TRUE(host->hosts_store());
  host->set("dtrain/rdzv/r1/joined", "1");

  // 127.0.0.2 also names this machine but is not the endpoint's host: a client.
  auto member = connect_tcp_rendezvous_store("127.0.0.2", port, timeout, kSecret);
  EXPECT_FALSE(member->hosts_store());
  EXPECT_EQ(member->try_get("dtrain/rdzv/r1/joined"), "1");
  EXPECT_EQ(member->add("dtrain/rdzv/r1/count", 2), 2);

  try {
    connect_tcp_rendezvous_store("127.0.0.2", port, timeout, kSecret + "-other");
    ADD_FAILURE() << "a wrong secret was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("its secret does not match"), std::string::npos) << e.what();
  }
  try {
    connect_tcp_rendezvous_store("127.0.0.2", port, timeout, "");
    ADD_FAILURE() << "no secret was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("requires a shared secret"), std::string::npos) << e.what();
  }
  // A stray program speaking c10d's protocol: its connection never gets through.
  EXPECT_ANY_THROW({
    auto stray = dtrain::dist::Store::tcp(
        {.host = "127.0.0.2", .port = port, .is_server = false, .timeout = std::chrono::seconds(2)});
    stray.set("dtrain/rdzv/r1/closed", "1");
  });
  EXPECT_EQ(host->try_get("dtrain/rdzv/r1/closed"), std::nullopt);
  EXPECT_EQ(member->try_get("dtrain/rdzv/r1/count"), "2");
}
