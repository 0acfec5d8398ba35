// The dict of FFI targets a platform module returns from `registrations()`; jax_oc128._native registers each
// capsule with XLA under its name.
#pragma once

#include "nanobind/nanobind.h"
#include "xla/ffi/api/c_api.h"

namespace oc128 {

inline nanobind::dict registrations(XLA_FFI_Handler* compress, XLA_FFI_Handler* verify, XLA_FFI_Handler* commit) {
  nanobind::dict targets;
  targets["oc128_compress"] = nanobind::capsule(reinterpret_cast<void*>(compress));
  targets["oc128_verify"] = nanobind::capsule(reinterpret_cast<void*>(verify));
  targets["oc128_commit"] = nanobind::capsule(reinterpret_cast<void*>(commit));
  return targets;
}

}  // namespace oc128
