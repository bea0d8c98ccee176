// dtrain::Error formatting and the internal-assert thrower.
#include "dtrain/error.h"

#include "dtrain/log.h"

namespace dtrain {
namespace {
std::string compose(const std::string& message, const std::string& hint) {
  std::string out = log::rank_tag();
  if (!out.empty()) out += ' ';
  out += message;
  if (!hint.empty()) {
    out += " Hint: ";
    out += hint;
  }
  return out;
}
}  // namespace

Error::Error(const std::string& message, const std::string& hint)
    : std::runtime_error(compose(message, hint)), message_(message), hint_(hint) {}

namespace detail {
void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  std::ostringstream out;
  out << "internal error at " << file << ':' << line << ": " << cond << " failed";
  if (!msg.empty()) out << ": " << msg;
  throw InternalError(out.str(), "this is a dtrain bug; please report it with the log above");
}
}  // namespace detail
}  // namespace dtrain
