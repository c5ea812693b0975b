#include "optim/state_decl.h"

namespace strata::optim {

std::size_t state_bytes(const std::vector<StateDecl>& states) {
  std::size_t bytes = 0;
  for (const StateDecl& d : states) bytes += rt::dtype_size(d.dtype);
  return bytes;
}

}  // namespace strata::optim
