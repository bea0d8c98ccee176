// Private: what a dtrain process does about SIGPIPE (Note [Broken pipes] in
// broken_pipes.cpp).
#pragma once

namespace dtrain::detail {

// Ignores SIGPIPE in this process if its action is still the default one; a
// handler the program installed, or an ignore it inherited, is kept. Called
// before dtrain opens connections through a library that writes without
// MSG_NOSIGNAL: the Gloo backend and a TCPStore server. Idempotent.
void ignore_broken_pipes();

// Gives SIGPIPE its default action, as a program started by a shell or by
// torchrun has it. For a child between fork and exec (async-signal-safe):
// the launcher's workers must not inherit the launcher's ignore (Note [Broken pipes]).
void default_broken_pipes_in_child();

}  // namespace dtrain::detail
