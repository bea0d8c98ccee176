// SIGPIPE in dtrain processes; see broken_pipes.h.
//
// Note [Broken pipes]
// A peer that dies leaves this process's connections to it broken, and
// writing to a broken connection raises SIGPIPE, whose default action ends
// the process: a survivor would die by signal 13 instead of getting the
// CommunicationError its wait reports (TensorParallelPeerDeath did so once in
// the full suite). Where dtrain writes to a socket itself it passes
// MSG_NOSIGNAL (the rendezvous gate, rdzv_auth.cpp), and c10d's TCPStore
// client does too (tcputil::sendBytes). Two libraries do not, and cannot be
// told to: Gloo's TCP pairs write with writev() (tcp/pair.cc; when the
// dead peer's reset arrives while a write is in flight, the write that reads
// the reset fails with ECONNRESET and the pair's next one raises SIGPIPE
// before the pair notices the peer is gone), and TCPStore's libuv server
// (libuv leaves SIGPIPE to the program on Linux; it hosts the store in
// rank 0 and the rendezvous store and lighthouse in `dtrain run`). Gloo's
// own tests ignore SIGPIPE for this reason, and Python ignores it at
// start-up, so torch's ranks never see it. A C++ program does not, so dtrain
// ignores it before it makes a Gloo group or hosts a store: writes to a
// broken connection then fail with EPIPE, which both libraries report as a
// lost peer. Only the default action is replaced: a program's own handler
// (or an ignore it was started with) is its choice. The ignore is process
// wide, so a program whose stdout is a closed pipe no longer dies on its
// next write either (its writes fail); that is what a Python rank and
// torchrun do too. An ignored signal stays ignored across exec, so the
// launcher gives its workers the default action back between fork and exec,
// as Python's subprocess does for torchrun's workers.
#include "broken_pipes.h"

#include <signal.h>

namespace dtrain::detail {

void ignore_broken_pipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) return;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, nullptr);
}

void default_broken_pipes_in_child() {
  struct sigaction standard {};
  standard.sa_handler = SIG_DFL;
  sigemptyset(&standard.sa_mask);
  ::sigaction(SIGPIPE, &standard, nullptr);
}

}  // namespace dtrain::detail
