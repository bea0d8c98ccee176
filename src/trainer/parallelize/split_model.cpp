// The model as this rank trains it under the plan's tp and cp (appliers.h):
// the one place the model's splits are applied, so that the pipeline, ZeRO
// and DDP appliers wrap whatever it gives alike.
#include "appliers.h"
#include "dtrain/error.h"
#include "dtrain/nn/context_parallel.h"

namespace dtrain::detail {

SplitModel split_model(const ApplyContext& c, dist::DeviceMesh& mesh) {
  const ModelParts& parts = c.parts;
  const bool cp = c.plan.cp > 1;
  if (cp) {
    DTRAIN_CHECK(
        parts.cp.targets && (c.plan.tp > 1 || (parts.cp.split && parts.cp.loss)), ConfigError,
        "the plan splits sequences over cp " << c.plan.cp << ", but the model gives no context-parallel split.",
        "set ModelParts::cp (split, targets and loss), or plan cp 1");
  }
  SplitModel m;
  m.full = parts.layers();
  if (c.plan.tp > 1) {
    DTRAIN_CHECK(parts.tp.split && parts.tp.loss, ConfigError,
                 "the plan splits the model over tp " << c.plan.tp << ", but the model gives no tensor-parallel split.",
                 "set ModelParts::tp (split and loss), or plan tp 1");
    // The full layers stay on the CPU, released while training, to assemble
    // the trained weights into.
    m.trained = parts.tp.split(m.full, mesh);
    m.trained->to(c.device());
    m.unshared = ReleasedParameters::release(*m.full, identities(m.trained->parameters()));  // until full_weights()
    m.tensor_parallel = true;
    m.loss = parts.tp.loss(mesh);
    if (cp) {
      // The tp loss is the mean over this rank's tokens (equal on every tp
      // rank); over cp its value is averaged and its gradient kept, as
      // ModelParts::cp's loss does.
      m.loss = [tp_loss = m.loss, group = mesh["cp"]](const at::Tensor& out, const at::Tensor& target) {
        return nn::cp::mean_loss(tp_loss(out, target), group);
      };
    }
  } else if (cp) {
    m.full->to(c.device());
    m.trained = parts.cp.split(m.full, mesh);  // shares full's modules
    m.loss = parts.cp.loss(mesh);
  } else {
    m.full->to(c.device());
    m.trained = m.full;
    m.loss = c.loss();
  }
  if (cp) {
    dist::DeviceMesh* on = &mesh;
    m.targets = [targets = parts.cp.targets, on](const at::Tensor& t) { return targets(t, *on); };
  }
  return m;
}

}  // namespace dtrain::detail
