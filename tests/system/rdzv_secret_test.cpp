// Who may join (Note [Rendezvous authentication]): two `dtrain run` nodes
// sharing a secret form a group while a node with another secret and one
// with none are refused with a message; the group they could have grown
// (--nnodes 2:3) stays at two nodes and finishes.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "launch_helpers.h"
#include "ranks.h"

using namespace dtrain::testing;

TEST(RdzvSecret, NodesWithoutTheSecretAreRefusedWhileTheJobGoesOn) {
  Scratch s;
  const auto good = s.path() / "secret";
  const auto bad = s.path() / "other-secret";
  std::ofstream(good) << "a-shared-secret-of-this-job-0123\n";
  std::ofstream(bad) << "another-jobs-secret-456789abcdef\n";
  const std::string worker = s.script(
      "worker.sh", "echo \"rank $RANK of $WORLD_SIZE\" >> " + (s.path() / "ranks.log").string() + "\nsleep 1\n");
  const int port = free_port();
  auto node = [&](const std::string& secret_file) {
    std::vector<std::string> args = {"--nnodes",         "2:3",
                                     "--nproc-per-node", "1",
                                     "--rdzv-endpoint",  "127.0.0.1:" + std::to_string(port),
                                     "--rdzv-id",        "secret",
                                     "--rdzv-conf",      "last_call_timeout=1",
                                     "--rdzv-timeout",   "30"};
    if (!secret_file.empty()) {
      args.push_back("--rdzv-secret-file");
      args.push_back(secret_file);
    }
    args.push_back(worker);
    return args;
  };
  Launch host(node(good.string()), s, "host");
  ASSERT_TRUE(wait_for([&] { return host.err().find("joins need the shared secret") != std::string::npos; }))
      << host.err();
  Launch wrong(node(bad.string()), s, "wrong");
  Launch none(node(""), s, "none");
  EXPECT_EQ(wrong.wait(std::chrono::seconds(30)), 2) << wrong.err();
  EXPECT_EQ(none.wait(std::chrono::seconds(30)), 2) << none.err();
  Launch member(node(good.string()), s, "member");
  EXPECT_EQ(host.wait(), 0) << host.err();
  EXPECT_EQ(member.wait(), 0) << member.err();

  EXPECT_NE(wrong.err().find("refused this node: its secret does not match the job's"), std::string::npos)
      << wrong.err();
  EXPECT_NE(none.err().find("requires a shared secret, and this node has none"), std::string::npos) << none.err();
  EXPECT_NE(host.err().find("refused a rendezvous connection from 127.0.0.1"), std::string::npos) << host.err();
  const std::string ranks = slurp(s.path() / "ranks.log");
  EXPECT_NE(ranks.find("rank 0 of 2"), std::string::npos) << ranks;
  EXPECT_NE(ranks.find("rank 1 of 2"), std::string::npos) << ranks;
  EXPECT_EQ(ranks.find("of 3"), std::string::npos) << ranks;
}
