// Every ProcessGroup operation against a reference: worlds 1..4, sizes 0, 1,
// odd and larger than one shared-memory slot, each dtype; the shared-memory
// transport against Gloo (bitwise where the order of the sum cannot differ)
// and both against the sums computed here.
#include <ATen/Functions.h>
#include <ATen/core/ivalue.h>
#include <gtest/gtest.h>

#include <csignal>
#include <thread>

#include "dtrain/comm/process_group.h"
#include "dtrain/error.h"
#include "ranks.h"

using dtrain::dist::ProcessGroup;
using dtrain::dist::ReduceOp;
using namespace dtrain::testing;

namespace {

constexpr std::int64_t kLarge = (8 << 20) / 4 + 1001;  // floats: more than one 8 MiB slot

// Rank r's input for a case: deterministic, so any rank can compute all of them.
at::Tensor input_of(int rank, std::int64_t n, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  if (at::isFloatingType(dtype)) return at::randn({n}, gen, at::kDouble).to(dtype);
  return at::randint(-50, 50, {n}, gen, at::kLong).to(dtype);
}

// The two groups each test rank uses: shared memory (the default on one
// host) and Gloo.
struct Groups {
  ProcessGroup shm;
  ProcessGroup gloo;
};
Groups make_groups(dtrain::dist::Store store, int rank, int world) {
  auto shm = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(60)});
  auto gloo = dtrain::dist::init_process_group(
      store, rank, world, {.timeout = std::chrono::seconds(60), .name = "gloo", .intra_host_shared_memory = false});
  return {shm, gloo};
}

// Bitwise where every rank's sum has one possible order (two ranks, or integers).
void expect_same(const at::Tensor& shm, const at::Tensor& gloo, const at::Tensor& reference, int world,
                 const std::string& what) {
  if (world <= 2 || !at::isFloatingType(shm.scalar_type())) {
    EXPECT_TRUE(at::equal(shm, gloo)) << what;
  }
  const double tol = shm.scalar_type() == at::kBFloat16 || shm.scalar_type() == at::kHalf ? 5e-2 : 1e-5;
  EXPECT_TRUE(at::allclose(shm.to(at::kDouble), reference.to(at::kDouble), tol, tol)) << what << " (shm)";
  EXPECT_TRUE(at::allclose(gloo.to(at::kDouble), reference.to(at::kDouble), tol, tol)) << what << " (gloo)";
}

struct Case {
  int world;
  std::int64_t n;
  at::ScalarType dtype;
};
std::string name(const Case& c) {
  return "w" + std::to_string(c.world) + "_n" + std::to_string(c.n) + "_" + c10::toString(c.dtype);
}

// One world's cases; each test below runs all of them over one pair of groups
// (a ctest case per size and dtype spent most of its time starting up).
std::vector<Case> cases(int world) {
  std::vector<Case> out;
  for (std::int64_t n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, std::int64_t{1000}}) {
    for (auto dtype : {at::kFloat, at::kDouble, at::kInt, at::kLong, at::kBFloat16}) out.push_back({world, n, dtype});
  }
  out.push_back({world, kLarge, at::kFloat});
  return out;
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllReduceEqualsGlooAndTheSum) {
  const int world = GetParam();
  const std::vector<Case> all = cases(world);
  std::vector<at::Tensor> sums;
  for (const Case& c : all) {
    at::Tensor sum = at::zeros({c.n}, at::kDouble);
    for (int r = 0; r < world; ++r) sum += input_of(r, c.n, c.dtype).to(at::kDouble);
    sums.push_back(sum);
  }
  // The shared-memory sum's contract, bitwise on every rank: in rank order,
  // in the dtype, one rounding per addition (ranks 0 and 1 read their own
  // partition from their input, the others from their slot: same values).
  std::vector<at::Tensor> rank_order_sums;
  for (const Case& c : all) {
    at::Tensor sum = input_of(0, c.n, c.dtype) + input_of(1 % world, c.n, c.dtype);
    if (world == 1) sum = input_of(0, c.n, c.dtype);
    for (int r = 2; r < world; ++r) sum += input_of(r, c.n, c.dtype);
    rank_order_sums.push_back(sum);
  }
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto [shm, gloo] = make_groups(store, rank, world);
    for (std::size_t i = 0; i < all.size(); ++i) {
      const Case& c = all[i];
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        at::Tensor a = input_of(rank, c.n, c.dtype), b = a.clone();
        shm.all_reduce(a, op).wait();
        gloo.all_reduce(b, op).wait();
        if (op == ReduceOp::kSum) {
          EXPECT_TRUE(at::equal(a, rank_order_sums[i])) << name(c) << " rank " << rank << ": not the rank-order sum";
        }
        at::Tensor reference = sums[i].clone();
        if (op == ReduceOp::kAvg) {
          reference = at::isFloatingType(c.dtype) ? at::div(sums[i], world) : at::div(sums[i], world, "trunc");
        } else if (op == ReduceOp::kMax) {
          reference = input_of(0, c.n, c.dtype).to(at::kDouble);
          for (int r = 1; r < world; ++r) reference = at::maximum(reference, input_of(r, c.n, c.dtype).to(at::kDouble));
        }
        expect_same(a, b, reference.to(c.dtype), world, name(c) + " " + dtrain::dist::to_string(op));
      }
    }
    EXPECT_EQ(shm.uses_shared_memory(), world > 1);
    EXPECT_FALSE(gloo.uses_shared_memory());
  });
}

TEST_P(Collectives, ReduceScatterEqualsGlooAndTheSum) {
  const int world = GetParam();
  const std::vector<Case> all = cases(world);
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto [shm, gloo] = make_groups(store, rank, world);
    for (const Case& c : all) {
      const std::int64_t n = c.n == kLarge ? kLarge / world : c.n;  // per rank
      at::Tensor sum = at::zeros({n * world}, at::kDouble);
      for (int r = 0; r < world; ++r) sum += input_of(r, n * world, c.dtype).to(at::kDouble);
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        const at::Tensor in = input_of(rank, n * world, c.dtype);
        at::Tensor a = at::empty({n}, in.options()), b = at::empty({n}, in.options());
        shm.reduce_scatter(a, in, op).wait();
        gloo.reduce_scatter(b, in, op).wait();
        at::Tensor reference = sum.narrow(0, rank * n, n);
        if (op == ReduceOp::kAvg) {
          reference = at::isFloatingType(c.dtype) ? at::div(reference, world) : at::div(reference, world, "trunc");
        }
        expect_same(a, b, reference.to(c.dtype), world, name(c) + " " + dtrain::dist::to_string(op));
      }
    }
  });
}

TEST_P(Collectives, AllGatherEqualsGlooAndTheInputs) {
  const int world = GetParam();
  const std::vector<Case> all = cases(world);
  run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
    auto [shm, gloo] = make_groups(store, rank, world);
    for (const Case& c : all) {
      std::vector<at::Tensor> inputs;
      for (int r = 0; r < world; ++r) inputs.push_back(input_of(r, c.n, c.dtype));
      const at::Tensor reference = at::cat(inputs);
      const at::Tensor in = input_of(rank, c.n, c.dtype);
      at::Tensor a = at::empty({c.n * world}, in.options()), b = at::empty({c.n * world}, in.options());
      shm.all_gather_into(a, in).wait();
      gloo.all_gather_into(b, in).wait();
      EXPECT_TRUE(at::equal(a, reference)) << name(c);
      EXPECT_TRUE(at::equal(b, reference)) << name(c);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(CollectivesMore, CoalescedBroadcastAndAllReduceMixDtypes) {
  for (int world : {1, 2, 3}) {
    run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(60)});
      std::vector<at::Tensor> tensors{at::full({3, 2}, rank + 1.0), at::full({5}, rank + 1, at::kLong),
                                      at::full({0}, 1.0), at::full({2}, rank + 0.5, at::kDouble)};
      group.all_reduce_coalesced(tensors, ReduceOp::kSum).wait();
      const double ranks_sum = world * (world + 1) / 2.0;
      EXPECT_TRUE(at::equal(tensors[0], at::full({3, 2}, ranks_sum)));
      EXPECT_TRUE(at::equal(tensors[1], at::full({5}, static_cast<std::int64_t>(ranks_sum), at::kLong)));
      EXPECT_TRUE(at::equal(tensors[3], at::full({2}, ranks_sum - world * 0.5, at::kDouble)));

      std::vector<at::Tensor> mine{at::full({4}, static_cast<float>(rank)), at::full({2, 2}, rank, at::kInt)};
      const int root = world - 1;
      group.broadcast_coalesced(mine, root).wait();
      EXPECT_TRUE(at::equal(mine[0], at::full({4}, static_cast<float>(root))));
      EXPECT_TRUE(at::equal(mine[1], at::full({2, 2}, root, at::kInt)));
    });
  }
}

TEST(CollectivesMore, FutureCompletesWithTheResult) {
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    at::Tensor t = at::full({3}, rank + 1.0);
    auto future = group.all_reduce(t, ReduceOp::kAvg).future();
    future->wait();
    ASSERT_FALSE(future->hasError());
    EXPECT_TRUE(at::equal(future->value().toTensor(), at::full({3}, 1.5)));
  });
}

// Work::wait() begun while a future() continuation is pending: the
// continuation and the wait share the operation's state, and wait() used to
// hold its lock while it waited, so the continuation (run on the completing
// thread before the wait is told) blocked the wait until the group timeout.
// Rank 1 enters late so that rank 0's wait starts before the operation ends;
// on both transports (Gloo's Work and the shared-memory future).
TEST(CollectivesMore, WaitWithAPendingFutureContinuationEndsWithTheOperation) {
  constexpr auto kTimeout = std::chrono::seconds(6);
  for (const bool shared_memory : {false, true}) {
    run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, 2,
                                                    {.timeout = kTimeout, .intra_host_shared_memory = shared_memory});
      for (int round = 0; round < 3; ++round) {
        at::Tensor t = at::full({1000}, rank + 1.0);
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
        }
        const auto start = std::chrono::steady_clock::now();
        dtrain::dist::Work work = group.all_reduce(t, ReduceOp::kSum);
        auto future = work.future();
        work.wait();
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_LT(waited, 2.0) << "rank " << rank << (shared_memory ? " (shared memory)" : " (gloo)")
                               << ": wait() stood until the group timeout";
        EXPECT_TRUE(at::equal(t, at::full({1000}, 3.0)));
        future->wait();
        ASSERT_FALSE(future->hasError()) << future->tryRetrieveErrorMessage();
        EXPECT_TRUE(at::equal(future->value().toTensor(), at::full({1000}, 3.0)));
      }
    });
  }
}

// Note [A failed operation] (shm_transport.cpp): rank 1 comes to an
// all-reduce after rank 0 gave up on it (the group timeout). Rank 0's next
// operation fails at once, and rank 1, which passes the first barrier rank 0
// published before it gave up, fails at the next one naming rank 0 within
// milliseconds, instead of pairing rank 0's next operation with this one
// (and reading its unsummed input) or waiting out its own timeout.
TEST(CollectivesMore, SharedMemoryEndsAllOperationsAfterOneFailed) {
  constexpr auto kTimeout = std::chrono::seconds(2);
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = kTimeout});
    at::Tensor warm = at::ones({8});
    group.all_reduce(warm).wait();  // sets the transport up on both ranks
    ASSERT_TRUE(group.uses_shared_memory());
    if (rank == 1) {
      std::this_thread::sleep_for(kTimeout + std::chrono::milliseconds(1500));
    }
    at::Tensor t = at::full({1000}, rank + 1.0);
    const auto start = std::chrono::steady_clock::now();
    std::string first;
    try {
      group.all_reduce(t).wait();
    } catch (const dtrain::CommunicationError& e) {
      first = e.what();
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rank == 0) {
      EXPECT_NE(first.find("peer rank 1"), std::string::npos) << first;
      at::Tensor next = at::ones({1000});
      std::string second;
      try {
        group.all_reduce(next).wait();
      } catch (const dtrain::CommunicationError& e) {
        second = e.what();
      }
      EXPECT_NE(second.find("unusable since an earlier operation failed"), std::string::npos) << second;
    } else {
      EXPECT_NE(first.find("peer rank 0 failed an earlier shared-memory operation"), std::string::npos) << first;
      EXPECT_LT(waited, 1.0) << "rank 1 waited out its timeout for a peer that had given up";
    }
  });
}

TEST(CollectivesMore, PointToPointRingAndBatch) {
  for (int world : {2, 3, 4}) {
    run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = std::chrono::seconds(60)});
      const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
      // Blocking send/recv in an order that works: even ranks send first.
      at::Tensor got = at::empty({5});
      if (rank % 2 == 0) {
        group.send(at::full({5}, static_cast<float>(rank)), next);
        group.recv(got, prev);
      } else {
        group.recv(got, prev);
        group.send(at::full({5}, static_cast<float>(rank)), next);
      }
      EXPECT_TRUE(at::equal(got, at::full({5}, static_cast<float>(prev))));
      // A batch in which every rank sends before it receives in program
      // order: batch_isend_irecv must still complete.
      std::vector<dtrain::dist::P2POp> ops{
          {.kind = dtrain::dist::P2POp::Kind::kSend, .tensor = at::full({7}, rank * 10.0), .peer = next, .tag = 3},
          {.kind = dtrain::dist::P2POp::Kind::kRecv, .tensor = at::empty({7}), .peer = prev, .tag = 3},
          {.kind = dtrain::dist::P2POp::Kind::kSend, .tensor = at::full({1}, 1, at::kLong), .peer = prev},
          {.kind = dtrain::dist::P2POp::Kind::kRecv, .tensor = at::empty({1}, at::kLong), .peer = next}};
      for (auto& w : group.batch_isend_irecv(ops)) w.wait();
      EXPECT_TRUE(at::equal(ops[1].tensor, at::full({7}, prev * 10.0)));
      EXPECT_EQ(ops[3].tensor.item<std::int64_t>(), 1);
    });
  }
}

TEST(CollectivesMore, BadShapesAndPeersAreClearErrors) {
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = std::chrono::seconds(60)});
    at::Tensor out = at::empty({3});
    try {
      group.reduce_scatter(out, at::zeros({5}));
      ADD_FAILURE() << "reduce_scatter accepted 5 elements for 2 x 3";
    } catch (const dtrain::CommunicationError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("[rank " + std::to_string(rank) + "/2] reduce_scatter(sum) on gloo group 'world'"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("Float[5] -> Float[3]"), std::string::npos) << what;
    }
    EXPECT_THROW(group.all_gather_into(out, at::zeros({2})), dtrain::CommunicationError);
    EXPECT_THROW(group.isend(at::zeros({1}), rank), dtrain::ConfigError);  // to itself
    EXPECT_THROW(group.isend(at::zeros({1}), 2), dtrain::ConfigError);     // no such rank
  });
}

// ---- a peer dying mid-operation: the survivor gets a CommunicationError ----

struct DeathCase {
  const char* op;
  bool shared_memory;
};

// So that gtest (and `ctest -N`) show the case, not its bytes (a pointer
// that changes from build to build).
void PrintTo(const DeathCase& c, std::ostream* os) {
  *os << c.op << (c.shared_memory ? " over shared memory" : " over Gloo");
}

class PeerDeath : public ::testing::TestWithParam<DeathCase> {};

TEST_P(PeerDeath, SurvivorGetsCommunicationErrorNamingRankOpAndPeer) {
  const DeathCase c = GetParam();
  const std::string op = c.op;
  const auto outcomes =
      run_rank_processes(2,
                         [&](int rank) {
                           auto group = dtrain::dist::init_process_group(
                               {.timeout = std::chrono::seconds(20), .intra_host_shared_memory = c.shared_memory});
                           // One operation of the kind first, so the transport is set up.
                           at::Tensor warm = at::empty({10});
                           if (op == "recv") {
                             group.barrier();
                           } else if (op == "reduce_scatter") {
                             group.reduce_scatter(warm, at::ones({20})).wait();
                           } else {
                             group.all_gather_into(warm, at::ones({5})).wait();
                           }
                           EXPECT_EQ(group.uses_shared_memory(), c.shared_memory);
                           if (rank == 1) std::raise(SIGKILL);
                           try {
                             if (op == "reduce_scatter") {
                               at::Tensor out = at::empty({1000});
                               group.reduce_scatter(out, at::ones({2000})).wait();
                             } else if (op == "all_gather") {
                               at::Tensor out = at::empty({2000});
                               group.all_gather_into(out, at::ones({1000})).wait();
                             } else {
                               at::Tensor in = at::empty({1000});
                               group.recv(in, 1);
                             }
                             ADD_FAILURE() << op << " completed without its peer";
                           } catch (const dtrain::CommunicationError& e) {
                             std::cerr << "survivor: " << e.what() << std::endl;
                           }
                         },
                         {.timeout = std::chrono::seconds(60), .expect_success = false});
  const std::string& out = outcomes[0].output;
  EXPECT_FALSE(outcomes[0].timed_out) << out;
  EXPECT_NE(out.find("survivor: [rank 0/2] " + op), std::string::npos) << out;
  if (op == "recv" || c.shared_memory) {
    EXPECT_NE(out.find("peer rank 1"), std::string::npos) << out;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, PeerDeath,
                         ::testing::Values(DeathCase{"reduce_scatter", true}, DeathCase{"reduce_scatter", false},
                                           DeathCase{"all_gather", true}, DeathCase{"recv", false}),
                         [](const auto& info) {
                           return std::string(info.param.op) + (info.param.shared_memory ? "_shm" : "_gloo");
                         });

}  // namespace
