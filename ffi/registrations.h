// The functions every platform module defines: `registrations()`, target name -> capsule of its XLA FFI handler
// (jax_oc128._native registers each with XLA under its name), and `operands()`, target name -> {"args", "rets",
// "attrs"}: the operand names of its binding, in binding order (jax_oc128._native checks them against the ops).
#pragma once

#include "attention_ffi.h"
#include "indexer_ffi.h"
#include "nanobind/nanobind.h"
#include "oc128_ffi.h"
#include "quant_gmm_ffi.h"
#include "xla/ffi/api/c_api.h"

namespace oc128 {

template <typename Op>
nanobind::dict operand_names() {
  nanobind::dict names;
  for (const char* kind : {"args", "rets", "attrs"}) names[kind] = nanobind::list();
  for_each_operand<Op>([&](const char* kind, const char* name) { names[kind].attr("append")(name); });
  return names;
}

inline void define_module(nanobind::module_& m, XLA_FFI_Handler* compress, XLA_FFI_Handler* verify,
                          XLA_FFI_Handler* commit, XLA_FFI_Handler* attention, XLA_FFI_Handler* quant_gmm,
                          XLA_FFI_Handler* indexer_scores) {
  m.def("registrations", [=]() {
    nanobind::dict targets;
    targets[Compress::kTarget] = nanobind::capsule(reinterpret_cast<void*>(compress));
    targets[Verify::kTarget] = nanobind::capsule(reinterpret_cast<void*>(verify));
    targets[Commit::kTarget] = nanobind::capsule(reinterpret_cast<void*>(commit));
    targets[Attention::kTarget] = nanobind::capsule(reinterpret_cast<void*>(attention));
    targets[QuantGmm::kTarget] = nanobind::capsule(reinterpret_cast<void*>(quant_gmm));
    targets[IndexerScores::kTarget] = nanobind::capsule(reinterpret_cast<void*>(indexer_scores));
    return targets;
  });
  m.def("operands", []() {
    nanobind::dict targets;
    targets[Compress::kTarget] = operand_names<Compress>();
    targets[Verify::kTarget] = operand_names<Verify>();
    targets[Commit::kTarget] = operand_names<Commit>();
    targets[Attention::kTarget] = operand_names<Attention>();
    targets[QuantGmm::kTarget] = operand_names<QuantGmm>();
    targets[IndexerScores::kTarget] = operand_names<IndexerScores>();
    return targets;
  });
}

}  // namespace oc128
