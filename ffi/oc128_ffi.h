// XLA FFI handler bodies shared by the CPU and CUDA modules: operand checks, dtype dispatch and the
// argument structs of oc128_math.h. The platform supplies a Backend with
//   ffi::Error copy(void* dst, const void* src, size_t bytes);
//   template <class T> ffi::Error compress(const CompressArgs<T>&, int64_t call_layers, int64_t segments);
//   template <int N, bool kTree, class T> ffi::Error verify(const VerifyArgs<T>&, int64_t call_layers);
//   ffi::Error commit(const CommitArgs&, int64_t num_layers);
// and one handler per op: a generic lambda that makes its Backend from its context operands and calls
// Op::run, bound with bind<Op>, so that the operand types and names are written once, here.
// Only Buffer, AnyBuffer, Result, Attr, Ctx and Error are used, so this compiles against the FFI
// headers of jaxlib 0.10 and 0.11 alike.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "oc128_math.h"
#include "xla/ffi/api/ffi.h"

namespace oc128 {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& message) { return ffi::Error::InvalidArgument("jax_oc128: " + message); }

template <typename Dims>
std::string shape_string(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Error unless `dims` equals `expected`.
template <typename Dims>
ffi::Error check_shape(const char* name, const Dims& dims, std::initializer_list<int64_t> expected) {
  bool same = dims.size() == expected.size();
  size_t i = 0;
  for (int64_t e : expected) same = same && dims[i++] == e;
  if (same) return ffi::Error::Success();
  std::string want = "[";
  i = 0;
  for (int64_t e : expected) want += (i++ ? ", " : "") + std::to_string(e);
  return invalid(std::string(name) + ": expected shape " + want + "], got " + shape_string(dims));
}

#define OC128_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ffi::Error oc128_error_ = (expr);                \
    if (oc128_error_.failure()) return oc128_error_; \
  } while (0)

// The state operand and its aliased result: [layers, banks, slots, 3, dim], fp32 or bf16, dim % 32 == 0,
// at least one slot.
struct StateShape {
  int64_t layers, banks, slots, dim;
  StateLayout layout() const { return StateLayout{banks, slots, dim}; }
};

template <typename Backend>
ffi::Error check_state(Backend& backend, const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out,
                       StateShape* shape) {
  const auto dims = in.dimensions();
  if (dims.size() != 5 || dims[3] != 3)
    return invalid("state: expected shape [layers, 1 + max_draft, slots, 3, head_dim], got " + shape_string(dims));
  if (in.element_type() != ffi::F32 && in.element_type() != ffi::BF16)
    return invalid("state: dtype must be float32 or bfloat16");
  *shape = StateShape{dims[0], dims[1], dims[2], dims[4]};
  if (shape->dim <= 0 || shape->dim % 32 != 0)
    return invalid("state: head_dim must be a positive multiple of 32, got " + std::to_string(shape->dim));
  if (shape->banks < 1) return invalid("state: needs at least bank 0");
  if (shape->slots < 1) return invalid("state: needs at least one slot");
  if (out->element_type() != in.element_type() || out->size_bytes() != in.size_bytes())
    return invalid("state: the result must alias the operand (same shape and dtype)");
  // XLA aliases the two buffers (input_output_aliases); copy defensively if it ever does not.
  if (out->untyped_data() != in.untyped_data())
    return backend.copy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  return ffi::Error::Success();
}

inline ffi::Error check_layers(int64_t layer, int64_t call_layers, int64_t state_layers) {
  if (layer < 0 || call_layers < 1 || layer + call_layers > state_layers)
    return invalid("layer: layers [" + std::to_string(layer) + ", " + std::to_string(layer + call_layers) +
                   ") are not inside the state's " + std::to_string(state_layers) + " layers");
  return ffi::Error::Success();
}

// f(std::integral_constant<int, N>) for the runtime n in [1, kMaxDraft]: verify is compiled per N.
template <int N = 1, typename F>
ffi::Error with_draft_tokens(int64_t n, F&& f) {
  if constexpr (N > kMaxDraft) {
    return invalid("verify: N must be in [1, 16], got " + std::to_string(n));
  } else {
    return n == N ? f(std::integral_constant<int, N>{}) : with_draft_tokens<N + 1>(n, f);
  }
}

template <typename Backend>
ffi::Error compress(Backend& backend, ffi::AnyBuffer state_in, ffi::Buffer<ffi::F32> kv_score,
                    ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> new_lens, ffi::Buffer<ffi::S32> slots,
                    ffi::Buffer<ffi::F32> ape, ffi::Result<ffi::AnyBuffer> state_out,
                    ffi::Result<ffi::Buffer<ffi::F32>> entries, ffi::Result<ffi::Buffer<ffi::S32>> entry_blocks,
                    int64_t layer) {
  StateShape st;
  OC128_RETURN_IF_ERROR(check_state(backend, state_in, state_out, &st));
  const auto kd = kv_score.dimensions();
  if (kd.size() != 4) return invalid("kv_score: expected rank 4 [layers, batch, tokens, 2*head_dim]");
  const int64_t call_layers = kd[0], rows = kd[1], tokens = kd[2], per_row = kd[2] / kBlock + 1;
  OC128_RETURN_IF_ERROR(check_shape("kv_score", kd, {call_layers, rows, tokens, 2 * st.dim}));
  OC128_RETURN_IF_ERROR(check_layers(layer, call_layers, st.layers));
  OC128_RETURN_IF_ERROR(check_shape("seq_lens", seq_lens.dimensions(), {rows}));
  OC128_RETURN_IF_ERROR(check_shape("new_lens", new_lens.dimensions(), {rows}));
  OC128_RETURN_IF_ERROR(check_shape("slots", slots.dimensions(), {rows}));
  OC128_RETURN_IF_ERROR(check_shape("ape", ape.dimensions(), {call_layers, kBlock, st.dim}));
  OC128_RETURN_IF_ERROR(check_shape("entries", entries->dimensions(), {call_layers, rows, per_row, st.dim}));
  OC128_RETURN_IF_ERROR(check_shape("entry_blocks", entry_blocks->dimensions(), {rows, per_row}));
  if (rows == 0) return ffi::Error::Success();
  auto run = [&](auto* state) {
    using T = std::remove_pointer_t<decltype(state)>;
    const CompressArgs<T> args{state,
                               kv_score.typed_data(),
                               seq_lens.typed_data(),
                               new_lens.typed_data(),
                               slots.typed_data(),
                               ape.typed_data(),
                               entries->typed_data(),
                               entry_blocks->typed_data(),
                               st.layout(),
                               layer,
                               rows,
                               tokens,
                               per_row};
    return backend.compress(args, call_layers, max_segments(tokens));
  };
  void* data = state_out->untyped_data();
  return state_in.element_type() == ffi::F32 ? run(static_cast<float*>(data)) : run(static_cast<Bf16*>(data));
}

template <typename Backend>
ffi::Error verify(Backend& backend, ffi::AnyBuffer state_in, ffi::Buffer<ffi::F32> kv_score,
                  ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> ape,
                  ffi::Buffer<ffi::S32> pending, ffi::Buffer<ffi::S32> pending_banks, ffi::Buffer<ffi::S32> tree,
                  ffi::Result<ffi::AnyBuffer> state_out, ffi::Result<ffi::Buffer<ffi::F32>> entries,
                  ffi::Result<ffi::Buffer<ffi::S32>> entry_blocks, int64_t layer) {
  StateShape st;
  OC128_RETURN_IF_ERROR(check_state(backend, state_in, state_out, &st));
  const auto kd = kv_score.dimensions();
  if (kd.size() != 4) return invalid("kv_score: expected rank 4 [layers, batch, num_tokens, 2*head_dim]");
  const int64_t call_layers = kd[0], rows = kd[1], tokens = kd[2];
  OC128_RETURN_IF_ERROR(check_shape("kv_score", kd, {call_layers, rows, tokens, 2 * st.dim}));
  if (tokens < 1 || tokens > st.banks - 1 || tokens > kMaxDraft)
    return invalid("kv_score: num_tokens must be in [1, min(max_draft, 16)] = [1, " +
                   std::to_string(st.banks - 1 < kMaxDraft ? st.banks - 1 : kMaxDraft) + "], got " +
                   std::to_string(tokens));
  OC128_RETURN_IF_ERROR(check_layers(layer, call_layers, st.layers));
  OC128_RETURN_IF_ERROR(check_shape("seq_lens", seq_lens.dimensions(), {rows}));
  OC128_RETURN_IF_ERROR(check_shape("slots", slots.dimensions(), {rows}));
  OC128_RETURN_IF_ERROR(check_shape("ape", ape.dimensions(), {call_layers, kBlock, st.dim}));
  if (pending.element_count() != 0) OC128_RETURN_IF_ERROR(check_shape("pending", pending.dimensions(), {st.slots}));
  if (pending_banks.element_count() != 0) {
    if (pending.element_count() == 0) return invalid("pending_banks: given without pending");
    OC128_RETURN_IF_ERROR(check_shape("pending_banks", pending_banks.dimensions(), {st.slots}));
  }
  const bool is_tree = tree.element_count() != 0;  // empty: the chain
  if (is_tree) OC128_RETURN_IF_ERROR(check_shape("tree", tree.dimensions(), {tokens}));
  const int64_t per_row = is_tree ? tokens : 1;
  OC128_RETURN_IF_ERROR(check_shape("entries", entries->dimensions(), {call_layers, rows, per_row, st.dim}));
  OC128_RETURN_IF_ERROR(check_shape("entry_blocks", entry_blocks->dimensions(), {rows, per_row}));
  if (rows == 0) return ffi::Error::Success();
  auto run = [&](auto* state) {
    using T = std::remove_pointer_t<decltype(state)>;
    const VerifyArgs<T> args{state,
                             kv_score.typed_data(),
                             seq_lens.typed_data(),
                             slots.typed_data(),
                             ape.typed_data(),
                             pending.element_count() ? pending.typed_data() : nullptr,
                             pending_banks.element_count() ? pending_banks.typed_data() : nullptr,
                             is_tree ? tree.typed_data() : nullptr,
                             entries->typed_data(),
                             entry_blocks->typed_data(),
                             st.layout(),
                             layer,
                             rows};
    return with_draft_tokens(tokens, [&](auto n) {
      constexpr int N = decltype(n)::value;
      return is_tree ? backend.template verify<N, true>(args, call_layers)
                     : backend.template verify<N, false>(args, call_layers);
    });
  };
  void* data = state_out->untyped_data();
  return state_in.element_type() == ffi::F32 ? run(static_cast<float*>(data)) : run(static_cast<Bf16*>(data));
}

template <typename Backend>
ffi::Error commit(Backend& backend, ffi::AnyBuffer state_in, ffi::Buffer<ffi::S32> seq_lens,
                  ffi::Buffer<ffi::S32> accept_lens, ffi::Buffer<ffi::S32> accept_banks, ffi::Buffer<ffi::S32> slots,
                  ffi::Result<ffi::AnyBuffer> state_out, int64_t layer, int64_t num_layers) {
  StateShape st;
  OC128_RETURN_IF_ERROR(check_state(backend, state_in, state_out, &st));
  OC128_RETURN_IF_ERROR(check_layers(layer, num_layers, st.layers));
  const int64_t rows = seq_lens.dimensions().size() == 1 ? seq_lens.dimensions()[0] : -1;
  if (rows < 0) return invalid("seq_lens: expected rank 1 [batch]");
  OC128_RETURN_IF_ERROR(check_shape("accept_lens", accept_lens.dimensions(), {rows}));
  if (accept_banks.element_count() != 0)
    OC128_RETURN_IF_ERROR(check_shape("accept_banks", accept_banks.dimensions(), {rows}));
  OC128_RETURN_IF_ERROR(check_shape("slots", slots.dimensions(), {rows}));
  if (rows == 0) return ffi::Error::Success();
  const int64_t value_bytes = state_in.element_type() == ffi::F32 ? 4 : 2;
  const CommitArgs args{static_cast<Word16*>(state_out->untyped_data()),
                        seq_lens.typed_data(),
                        accept_lens.typed_data(),
                        accept_banks.element_count() ? accept_banks.typed_data() : nullptr,
                        slots.typed_data(),
                        st.banks,
                        st.slots,
                        3 * st.dim * value_bytes / int64_t(sizeof(Word16)),
                        layer,
                        rows};
  return backend.commit(args, num_layers);
}

// The operands of each op, named once: a Compress/Verify/Commit descriptor lists them in the order of the
// function above, and both the FFI binding (bind<Op>) and the names a module reports (for_each_operand) are
// generated from that list. The platform prepends its context operands to the binding.
template <typename T>
struct NamedArg {
  static constexpr const char* kKind = "args";
  const char* name;
};
template <typename T>
struct NamedRet {
  static constexpr const char* kKind = "rets";
  const char* name;
};
template <typename T>
struct NamedAttr {
  static constexpr const char* kKind = "attrs";
  const char* name;
};

struct Compress {
  static constexpr const char* kTarget = "oc128_compress";
  static constexpr auto kOperands =
      std::make_tuple(NamedArg<ffi::AnyBuffer>{"state"}, NamedArg<ffi::Buffer<ffi::F32>>{"kv_score"},
                      NamedArg<ffi::Buffer<ffi::S32>>{"seq_lens"}, NamedArg<ffi::Buffer<ffi::S32>>{"new_lens"},
                      NamedArg<ffi::Buffer<ffi::S32>>{"slots"}, NamedArg<ffi::Buffer<ffi::F32>>{"ape"},
                      NamedRet<ffi::AnyBuffer>{"state"}, NamedRet<ffi::Buffer<ffi::F32>>{"entries"},
                      NamedRet<ffi::Buffer<ffi::S32>>{"entry_blocks"}, NamedAttr<int64_t>{"layer"});
  template <typename Backend, typename... Operands>
  static ffi::Error run(Backend& backend, Operands... operands) {
    return compress(backend, std::move(operands)...);
  }
};

struct Verify {
  static constexpr const char* kTarget = "oc128_verify";
  static constexpr auto kOperands =
      std::make_tuple(NamedArg<ffi::AnyBuffer>{"state"}, NamedArg<ffi::Buffer<ffi::F32>>{"kv_score"},
                      NamedArg<ffi::Buffer<ffi::S32>>{"seq_lens"}, NamedArg<ffi::Buffer<ffi::S32>>{"slots"},
                      NamedArg<ffi::Buffer<ffi::F32>>{"ape"}, NamedArg<ffi::Buffer<ffi::S32>>{"pending"},
                      NamedArg<ffi::Buffer<ffi::S32>>{"pending_banks"}, NamedArg<ffi::Buffer<ffi::S32>>{"tree"},
                      NamedRet<ffi::AnyBuffer>{"state"}, NamedRet<ffi::Buffer<ffi::F32>>{"entries"},
                      NamedRet<ffi::Buffer<ffi::S32>>{"entry_blocks"}, NamedAttr<int64_t>{"layer"});
  template <typename Backend, typename... Operands>
  static ffi::Error run(Backend& backend, Operands... operands) {
    return verify(backend, std::move(operands)...);
  }
};

struct Commit {
  static constexpr const char* kTarget = "oc128_commit";
  static constexpr auto kOperands =
      std::make_tuple(NamedArg<ffi::AnyBuffer>{"state"}, NamedArg<ffi::Buffer<ffi::S32>>{"seq_lens"},
                      NamedArg<ffi::Buffer<ffi::S32>>{"accept_lens"}, NamedArg<ffi::Buffer<ffi::S32>>{"accept_banks"},
                      NamedArg<ffi::Buffer<ffi::S32>>{"slots"}, NamedRet<ffi::AnyBuffer>{"state"},
                      NamedAttr<int64_t>{"layer"}, NamedAttr<int64_t>{"num_layers"});
  template <typename Backend, typename... Operands>
  static ffi::Error run(Backend& backend, Operands... operands) {
    return commit(backend, std::move(operands)...);
  }
};

// A Binding cannot be copied or moved, only extended (std::move(binding).Arg<T>() returns a new one), so it is
// passed by reference and every step returns the extended binding.
template <typename B, typename T>
auto bind_operand(B&& binding, NamedArg<T>) {
  return std::move(binding).template Arg<T>();
}
template <typename B, typename T>
auto bind_operand(B&& binding, NamedRet<T>) {
  return std::move(binding).template Ret<T>();
}
template <typename B, typename T>
auto bind_operand(B&& binding, NamedAttr<T> attr) {
  return std::move(binding).template Attr<T>(attr.name);
}

template <typename B, typename Operand, typename... Rest>
auto bind_operands(B&& binding, Operand operand, Rest... rest) {
  if constexpr (sizeof...(Rest) == 0) {
    return bind_operand(std::move(binding), operand);
  } else {
    return bind_operands(bind_operand(std::move(binding), operand), rest...);
  }
}

// `binding` (Ffi::Bind() with the platform's context) followed by Op's operands.
template <typename Op, typename B>
auto bind(B&& binding) {
  return std::apply([&](auto... operands) { return bind_operands(std::move(binding), operands...); }, Op::kOperands);
}

// f(kind, name) for each operand of Op in binding order, kind being "args", "rets" or "attrs".
template <typename Op, typename F>
void for_each_operand(F&& f) {
  std::apply([&](auto... operands) { (f(decltype(operands)::kKind, operands.name), ...); }, Op::kOperands);
}

}  // namespace oc128
