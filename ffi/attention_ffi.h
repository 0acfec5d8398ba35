// The attention op (oc128_attention): each query's heads attend, in one softmax with a per-head sink, to the keys
// its lists name in a pool of rows (K = V, one KV head: MQA). Shared by the CPU handler (a reference loop,
// attention_cpu.cc) and the CUDA kernel (attention_cuda.cu): the operands, their checks and which pool row the
// k-th key of a query is. The platform supplies a Backend with
//   template <class T> ffi::Error attention(const AttentionArgs<T>&);
//
// Operands (row-major):
//   q       [batch, tokens, heads, dim]      float32 or bfloat16
//   kv      [batch, pool, dim]               the dtype of q: keys and values alike
//   index   [batch, tokens, picks]           int32: pool rows, -1 (or anything outside [0, pool)): no key
//   ranges  [batch, tokens, num_ranges, 2]   int32: [begin, end) of pool rows, clipped to [0, pool)
//   sinks   [heads]                          float32, finite
//   out     [batch, tokens, heads, dim]      float32
//   workspace [n]                            float32: n = batch * tokens * splits * heads * (dim + 2), or 0
//                                            (one split); the CUDA kernel's partial results when it splits each
//                                            query's keys into `splits` parts (attention_op.splits chooses);
//                                            the CPU handler leaves it unwritten
//   scale   attribute (float32): the logits are scale * q . k
// A query's keys are its picks (index order) then each range's rows: a multiset (a row named twice counts twice).
// out = sum_k exp(l_k - m) v_k / (sum_k exp(l_k - m) + exp(sink - m)), m = max(max_k l_k, sink); no key: 0.
// Only the rows a query names are read: the rest of the pool may hold anything (NaN).
#pragma once

#include <cstdint>
#include <utility>

#include "oc128_ffi.h"

namespace oc128 {

template <typename T>
struct AttentionArgs {
  const T* q;
  const T* kv;
  const int32_t* index;
  const int32_t* ranges;
  const float* sinks;
  float* out;
  float* workspace;
  int64_t batch, tokens, heads, dim, pool, picks, num_ranges, splits;
  float scale;

  // The ranges of query `bq` (= b * tokens + t): range r clipped to [0, pool), as (begin, length >= 0).
  OC128_FN void range(int64_t bq, int64_t r, int64_t* begin, int64_t* length) const {
    const int32_t* at = ranges + (bq * num_ranges + r) * 2;
    const int64_t lo = at[0] < 0 ? 0 : at[0], hi = at[1] > pool ? pool : at[1];
    *begin = lo;
    *length = hi > lo ? hi - lo : 0;
  }

  // How many keys query `bq` lists (its picks, -1 included, and its ranges' rows).
  OC128_FN int64_t count(int64_t bq) const {
    int64_t n = picks;
    for (int64_t r = 0; r < num_ranges; ++r) {
      int64_t begin, length;
      range(bq, r, &begin, &length);
      n += length;
    }
    return n;
  }

  // The pool row of query `bq`'s k-th key (0 <= k < count(bq)), or -1 for none.
  OC128_FN int64_t key(int64_t bq, int64_t k) const {
    if (k < picks) {
      const int32_t row = index[bq * picks + k];
      return row >= 0 && row < pool ? row : -1;
    }
    k -= picks;
    for (int64_t r = 0; r < num_ranges; ++r) {
      int64_t begin, length;
      range(bq, r, &begin, &length);
      if (k < length) return begin + k;
      k -= length;
    }
    return -1;
  }
};

template <typename Backend>
ffi::Error attention(Backend& backend, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> index,
                     ffi::Buffer<ffi::S32> ranges, ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::Buffer<ffi::F32>> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale) {
  const auto qd = q.dimensions(), kd = kv.dimensions(), id = index.dimensions(), rd = ranges.dimensions();
  if (qd.size() != 4) return invalid("q: expected rank 4 [batch, tokens, heads, head_dim], got " + shape_string(qd));
  if (q.element_type() != ffi::F32 && q.element_type() != ffi::BF16)
    return invalid("q: dtype must be float32 or bfloat16");
  if (kv.element_type() != q.element_type()) return invalid("kv: dtype must be q's");
  const int64_t batch = qd[0], tokens = qd[1], heads = qd[2], dim = qd[3];
  if (kd.size() != 3) return invalid("kv: expected rank 3 [batch, pool, head_dim], got " + shape_string(kd));
  const int64_t pool = kd[1];
  OC128_RETURN_IF_ERROR(check_shape("kv", kd, {batch, pool, dim}));
  if (id.size() != 3) return invalid("index: expected rank 3 [batch, tokens, picks], got " + shape_string(id));
  OC128_RETURN_IF_ERROR(check_shape("index", id, {batch, tokens, id[2]}));
  if (rd.size() != 4) return invalid("ranges: expected rank 4 [batch, tokens, num_ranges, 2], got " + shape_string(rd));
  OC128_RETURN_IF_ERROR(check_shape("ranges", rd, {batch, tokens, rd[2], 2}));
  OC128_RETURN_IF_ERROR(check_shape("sinks", sinks.dimensions(), {heads}));
  OC128_RETURN_IF_ERROR(check_shape("out", out->dimensions(), {batch, tokens, heads, dim}));
  const auto wd = workspace->dimensions();
  const int64_t unit = batch * tokens * heads * (dim + 2), spare = wd.size() == 1 ? wd[0] : -1;
  if (spare < 0 || (spare > 0 && (unit == 0 || spare % unit != 0)))
    return invalid("workspace: expected [0] or [splits * " + std::to_string(unit) + "], got " + shape_string(wd));
  if (batch * tokens * heads * dim == 0) return ffi::Error::Success();
  auto run = [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    const AttentionArgs<T> args{typed,
                                static_cast<const T*>(kv.untyped_data()),
                                index.typed_data(),
                                ranges.typed_data(),
                                sinks.typed_data(),
                                out->typed_data(),
                                workspace->typed_data(),
                                batch,
                                tokens,
                                heads,
                                dim,
                                pool,
                                id[2],
                                rd[2],
                                spare == 0 ? 1 : spare / unit,
                                scale};
    return backend.attention(args);
  };
  const void* data = q.untyped_data();
  return q.element_type() == ffi::F32 ? run(static_cast<const float*>(data)) : run(static_cast<const Bf16*>(data));
}

struct Attention {
  static constexpr const char* kTarget = "oc128_attention";
  static constexpr auto kOperands = std::make_tuple(
      NamedArg<ffi::AnyBuffer>{"q"}, NamedArg<ffi::AnyBuffer>{"kv"}, NamedArg<ffi::Buffer<ffi::S32>>{"index"},
      NamedArg<ffi::Buffer<ffi::S32>>{"ranges"}, NamedArg<ffi::Buffer<ffi::F32>>{"sinks"},
      NamedRet<ffi::Buffer<ffi::F32>>{"out"}, NamedRet<ffi::Buffer<ffi::F32>>{"workspace"}, NamedAttr<float>{"scale"});
  template <typename Backend, typename... Operands>
  static ffi::Error run(Backend& backend, Operands... operands) {
    return attention(backend, std::move(operands)...);
  }
};

}  // namespace oc128
