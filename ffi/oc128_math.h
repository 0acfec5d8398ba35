// The single source of truth for jax_oc128's math, compiled into the CPU handlers (g++) and the CUDA
// kernels (nvcc). Everything here is plain arithmetic on pointers: no XLA, CUDA runtime or nanobind.
//
// Per work item ("channel" d of one row of one layer) it defines what the compress, verify and commit
// ops do. The CPU handlers loop over work items; the CUDA kernels map them onto threads.
//
// State layout (row-major): state[layers][banks][slots][3][dim], the 3 fields being
// [max | sum | mean] of the online softmax pooling of the open 128-token block (SPEC section 3).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __CUDACC__
#define OC128_FN __host__ __device__ __forceinline__
#else
#define OC128_FN inline
#endif

namespace oc128 {

constexpr int kBlock = 128;    // tokens per compressed block (C128)
constexpr int kMaxDraft = 16;  // most verify tokens per request (banks 1..16)

// ---------------------------------------------------------------------------------------------
// Storage types. bfloat16 is handled as raw bits so that host and device share one rounding rule
// (round to nearest even, as jnp.astype(jnp.bfloat16)).

struct Bf16 {
  uint16_t bits;
};

OC128_FN float float_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

OC128_FN uint32_t bits_from_float(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

OC128_FN float to_float(float x) { return x; }
OC128_FN float to_float(Bf16 x) { return float_from_bits(uint32_t(x.bits) << 16); }

template <typename T>
OC128_FN T from_float(float x);

template <>
OC128_FN float from_float<float>(float x) {
  return x;
}

template <>
OC128_FN Bf16 from_float<Bf16>(float x) {
  if (x != x) return Bf16{0x7FC0};  // quiet NaN
  const uint32_t u = bits_from_float(x);
  return Bf16{uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

// ---------------------------------------------------------------------------------------------
// The online recurrence of SPEC section 3 for one channel.
//
// Domain: kv values are finite; a score (score + ape) is finite or -inf. A -inf score has weight zero:
// the token changes nothing. A block whose scores are all -inf so far has no weight: its state is
// (max, sum, mean) = (-inf, 0, 0) and, if it closes so, its entry is 0. NaN and +inf scores are outside
// the domain: the block's state and entry are then unspecified (NaN or finite), but nothing outside the
// row's slot, and nothing after the block closes, is affected (the next block starts afresh).

// In registers the mean is carried as its numerator (mean * sum), so that a fold has one exp and two
// fmas on its critical path and no division; the stored state holds the normalised mean.
struct Online {
  float m;    // running max of the scores, -inf while the block has no weight
  float s;    // sum of exp(score - m), 0 while the block has no weight
  float num;  // sum of exp(score - m) * kv; the mean is num / s (0 without weight)

  OC128_FN float mean() const { return s == 0.0f ? 0.0f : num / s; }
};

// Fold one token at block position `pos` (kv `v`, score incl. ape `sigma`) into `st`.
// pos == 0 starts a new block: whatever `st` holds is ignored. Of the two rescale factors
// exp(m - max) and exp(sigma - max) one is 1, so a single exp of -|sigma - m| gives both; a state
// without weight (m = -inf) takes a finite sigma as its max and is scaled by exp(-inf) = 0.
OC128_FN Online fold(Online st, int pos, float v, float sigma) {
  if (sigma == -INFINITY) return pos == 0 ? Online{sigma, 0.0f, 0.0f} : st;  // weight zero
  if (pos == 0) return Online{sigma, 1.0f, v};
  const bool new_max = sigma > st.m;
  const float t = expf(new_max ? st.m - sigma : sigma - st.m);
  const float keep = new_max ? t : 1.0f, add = new_max ? 1.0f : t;
  return Online{new_max ? sigma : st.m, st.s * keep + add, st.num * keep + v * add};
}

// Stored states keep (m, s) consistent after rounding: m is rounded first and s is rescaled to the
// rounded max, so a bf16 state loses precision in s and a only (fp32 stores m exactly: no rescale, nor
// where rounding keeps m, as -inf).
template <typename T>
OC128_FN void store_state(T* row, int64_t dim, int64_t d, Online st) {
  const T m = from_float<T>(st.m);
  const float rounded = to_float(m);
  row[d] = m;
  row[dim + d] = from_float<T>(rounded == st.m ? st.s : st.s * expf(st.m - rounded));
  row[2 * dim + d] = from_float<T>(st.mean());
}

// Loads of the read-only inputs (tokens, ape) go through the read-only data cache on the GPU.
OC128_FN float load_input(const float* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

template <typename T>
OC128_FN Online load_state(const T* row, int64_t dim, int64_t d) {
  const float s = to_float(row[dim + d]);
  return Online{to_float(row[d]), s, to_float(row[2 * dim + d]) * s};
}

// The rows of a call as the skip rule sees them. A row is valid if its slot is inside the state, its
// seq_len is not negative and its count (compress: new_lens, commit: accept_lens; verify has none) is in
// [0, max_count]. A row is processed if it is valid and no earlier valid row of the call has its slot;
// any other row (padding: slot -1, out of range, or a repeated slot) is neither read nor written, and its
// outputs are those of a padding row (entries 0, entry_blocks -1).
struct Rows {
  const int32_t* slots;
  const int32_t* seq_lens;
  const int32_t* counts;  // nullptr: no count
  int32_t max_count;
  int64_t num_slots;

  OC128_FN bool valid(int64_t row) const {
    const int32_t slot = slots[row];
    const bool count_ok = counts == nullptr || (counts[row] >= 0 && counts[row] <= max_count);
    return slot >= 0 && slot < num_slots && seq_lens[row] >= 0 && count_ok;
  }

  // Whether one of the valid rows first, first + step, ... before `row` has the slot of `row`: with
  // (0, 1) all earlier rows; the CUDA kernels split them among a block's threads and or the answers.
  OC128_FN bool slot_taken(int64_t row, int64_t first, int64_t step) const {
    for (int64_t r = first; r < row; r += step)
      if (slots[r] == slots[row] && valid(r)) return true;
    return false;
  }

  OC128_FN bool processed(int64_t row) const { return valid(row) && !slot_taken(row, 0, 1); }
};

// The commit rule (SPEC section 4): after keeping `accept` tokens of the verify at `seq`, bank 0 becomes
// `bank`, the bank of the last kept token (the chain: bank `accept`; a tree: the accepted node k's bank
// k + 1), except when nothing was kept, `accept` or `bank` is out of range, or the block closed at the
// last kept token (bank 0 is then never read: the next token starts a block). Returns the bank to copy
// into bank 0, 0 for none.
OC128_FN int32_t committed_bank(int32_t seq, int32_t accept, int32_t bank, int64_t banks) {
  const bool in_range = accept >= 1 && accept < banks && bank >= 1 && bank < banks;
  return in_range && (seq + accept) % kBlock != 0 ? bank : 0;
}

// Where bank 0 of `slot` lives, for layer `layer` (absolute) of the state.
struct StateLayout {
  int64_t banks;  // 1 + max_draft
  int64_t slots;
  int64_t dim;
  OC128_FN int64_t offset(int64_t layer, int64_t bank, int64_t slot) const {
    return ((layer * banks + bank) * slots + slot) * 3 * dim;
  }
};

// ---------------------------------------------------------------------------------------------
// compress: fold new_lens[row] tokens into bank 0, emit an entry for each block that closes.
//
// Work item (lk, row, g, d): segment g of the row is the part of its new tokens lying in the
// g-th block touched (g = 0 is the block of the first new token). Segments are independent except
// that segment 0 reads bank 0 and the trailing open segment writes it, so both are done by the
// work item of segment 0 (read before write, in one thread: no race between CUDA blocks).

template <typename T>
struct CompressArgs {
  T* state;
  const float* kv_score;  // [call_layers, rows, tokens, 2*dim]
  const int32_t* seq_lens;
  const int32_t* new_lens;
  const int32_t* slots;
  const float* ape;       // [call_layers, 128, dim]
  float* entries;         // [call_layers, rows, entries_per_row, dim]
  int32_t* entry_blocks;  // [rows, entries_per_row]
  StateLayout layout;
  int64_t layer0;
  int64_t rows;
  int64_t tokens;
  int64_t entries_per_row;

  OC128_FN Rows call_rows() const { return Rows{slots, seq_lens, new_lens, int32_t(tokens), layout.slots}; }
};

// Segments a call of `tokens` tokens can touch: ceil((127 + tokens) / 128).
OC128_FN int64_t max_segments(int64_t tokens) { return (tokens + 2 * kBlock - 2) / kBlock; }

template <typename T>
OC128_FN Online fold_segment(const CompressArgs<T>& a, int64_t lk, int64_t row, int p0, int n, int64_t g, Online st,
                             int64_t d) {
  const int64_t dim = a.layout.dim;
  const int64_t first = g == 0 ? 0 : g * kBlock - p0;
  const int64_t end = (g + 1) * kBlock - p0 < n ? (g + 1) * kBlock - p0 : n;
  const float* kv = a.kv_score + (lk * a.rows + row) * a.tokens * 2 * dim;
  const float* ape = a.ape + lk * kBlock * dim;
  for (int64_t t = first; t < end; ++t) {
    const int pos = int(p0 + t - g * kBlock);
    st = fold(st, pos, load_input(kv + t * 2 * dim + d),
              load_input(kv + t * 2 * dim + dim + d) + load_input(ape + pos * dim + d));
  }
  return st;
}

// `processed`: Rows::processed of the row (the backend computes it once per row).
template <typename T>
OC128_FN void compress_channel(const CompressArgs<T>& a, int64_t lk, int64_t row, int64_t g, int64_t d,
                               bool processed) {
  const int64_t dim = a.layout.dim;
  const int32_t slot = a.slots[row], seq = a.seq_lens[row];
  const int n = processed ? a.new_lens[row] : 0;
  const int p0 = processed ? seq % kBlock : 0;
  const int64_t closed = (p0 + n) / kBlock;
  const int64_t segments = n > 0 ? (p0 + n + kBlock - 1) / kBlock : 0;  // no new token: nothing touched
  const int64_t trailing = (p0 + n) % kBlock != 0 ? segments - 1 : -1;  // the open segment, if any
  float* entry = a.entries + ((lk * a.rows + row) * a.entries_per_row + g) * dim;

  if (g < a.entries_per_row) {
    if (lk == 0 && d == 0) a.entry_blocks[row * a.entries_per_row + g] = g < closed ? seq / kBlock + int32_t(g) : -1;
    if (g >= closed) entry[d] = 0.0f;
  }
  if (g >= segments || (g == trailing && g != 0)) return;

  T* bank0 = a.state + a.layout.offset(a.layer0 + lk, 0, slot);
  Online st = g == 0 && p0 != 0 ? load_state(bank0, dim, d) : Online{0.0f, 0.0f, 0.0f};
  st = fold_segment(a, lk, row, p0, n, g, st, d);
  if (g < closed) {
    entry[d] = st.mean();
  } else {
    store_state(bank0, dim, d, st);  // g == trailing == 0
  }
  if (g == 0 && trailing > 0) {
    st = fold_segment(a, lk, row, p0, n, trailing, st, d);
    store_state(bank0, dim, d, st);
  }
}

// ---------------------------------------------------------------------------------------------
// verify: fold the N tokens of a verify starting from bank 0; the state after token (node) k goes to
// bank k + 1 unless the block closed at that token; bank 0 is not written.
//
// The tokens form a chain (token k follows token k - 1) or a tree: token k follows its parent
// tree[k] (an earlier node; the root, node 0, follows the committed state) and sits at position
// seq + depth(k). The state after node k is then the fold of the path from the root to node k. A node
// closing a block emits its entry: the chain has one entry slot per row (N <= 16 < 128 tokens close at
// most one block), a tree one per node.
//
// With a pending table ([slots], the seq length of each slot's previous verify, -1 for none), the row
// first commits that verify (accept = seq - pending[slot], the bank pending_banks[slot], or accept
// where there is no such table) in the call's layers: the lazy commit and the next verify in one launch.
//
// Work item (lk, row, d). N (the verify's token count, 1..16) and whether the tokens form a tree are
// compile-time constants, so that the N tokens' loads are all issued, into registers, before the
// serial fold, and the chain keeps constant indices.

template <typename T>
struct VerifyArgs {
  T* state;
  const float* kv_score;  // [call_layers, rows, tokens, 2*dim]
  const int32_t* seq_lens;
  const int32_t* slots;
  const float* ape;              // [call_layers, 128, dim]
  const int32_t* pending;        // [slots] or nullptr
  const int32_t* pending_banks;  // [slots] or nullptr: the chain's bank (accept)
  const int32_t* tree;           // [tokens] parent indices, or nullptr: the chain
  float* entries;                // [call_layers, rows, 1 (chain) or tokens (tree), dim]
  int32_t* entry_blocks;         // [rows, 1 (chain) or tokens (tree)]
  StateLayout layout;
  int64_t layer0;
  int64_t rows;

  OC128_FN Rows call_rows() const { return Rows{slots, seq_lens, nullptr, 0, layout.slots}; }
};

// The nodes of a verify of N tokens: node k's parent (-1: the committed state) and depth. The chain's
// are k - 1 and k, compile-time; a tree's come from `tree`, where a parent that is not an earlier node
// (outside the domain: the ops check trees at trace time) makes the node a root.
template <int N, bool kTree>
struct Nodes {
  int parents[kTree ? N : 1];
  int depths[kTree ? N : 1];

  OC128_FN explicit Nodes(const int32_t* tree) {
    if constexpr (kTree) {
      for (int k = 0; k < N; ++k) {
        const int32_t p = tree[k];
        parents[k] = p >= 0 && p < k ? p : -1;
        depths[k] = parents[k] < 0 ? 0 : depths[parents[k]] + 1;
      }
    }
  }
  OC128_FN int parent(int k) const {
    if constexpr (kTree) return parents[k];
    return k - 1;
  }
  OC128_FN int depth(int k) const {
    if constexpr (kTree) return depths[k];
    return k;
  }
};

// `processed`: Rows::processed of the row (the backend computes it once per row).
template <int N, bool kTree, typename T>
OC128_FN void verify_channel(const VerifyArgs<T>& a, int64_t lk, int64_t row, int64_t d, bool processed) {
  static_assert(1 <= N && N <= kMaxDraft, "1 <= N <= 16 verify tokens");
  constexpr int kEntries = kTree ? N : 1;
  const int64_t dim = a.layout.dim;
  const int32_t slot = a.slots[row], seq = a.seq_lens[row];
  float* entry = a.entries + (lk * a.rows + row) * kEntries * dim;
  if (!processed) {
    for (int e = 0; e < kEntries; ++e) entry[e * dim + d] = 0.0f;
    if (lk == 0 && d == 0)
      for (int e = 0; e < kEntries; ++e) a.entry_blocks[row * kEntries + e] = -1;
    return;
  }
  const Nodes<N, kTree> nodes(a.tree);
  const int p0 = seq % kBlock;
  const float* kv = a.kv_score + (lk * a.rows + row) * N * 2 * dim;
  const float* ape = a.ape + lk * kBlock * dim;
  float v[N], sigma[N];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int k = 0; k < N; ++k) {
    v[k] = load_input(kv + k * 2 * dim + d);
    sigma[k] = load_input(kv + k * 2 * dim + dim + d) + load_input(ape + ((p0 + nodes.depth(k)) % kBlock) * dim + d);
  }
  T* bank0 = a.state + a.layout.offset(a.layer0 + lk, 0, slot);
  const int64_t bank_stride = a.layout.slots * 3 * dim;
  const int32_t before = a.pending != nullptr ? a.pending[slot] : -1;
  const int32_t accept = seq - before;
  const int32_t kept = a.pending_banks != nullptr ? a.pending_banks[slot] : accept;
  const int32_t bank = before >= 0 ? committed_bank(before, accept, kept, a.layout.banks) : 0;
  const T* committed = bank0 + bank * bank_stride;
  Online st = p0 != 0 ? load_state(committed, dim, d) : Online{0.0f, 0.0f, 0.0f};
  if (bank != 0)
    for (int f = 0; f < 3; ++f) bank0[f * dim + d] = committed[f * dim + d];
  // A tree: where a root starts (the committed state) and where each node's children start (the state
  // after it). The chain needs neither (the compiler drops them).
  const Online root = st;
  Online after[kEntries];
  float closed_entry = 0.0f;
  int32_t closed_block = -1;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int k = 0; k < N; ++k) {
    const int pos = (p0 + nodes.depth(k)) % kBlock;
    if constexpr (kTree) st = nodes.parent(k) < 0 ? root : after[nodes.parent(k)];
    st = fold(st, pos, v[k], sigma[k]);
    const bool closes = pos == kBlock - 1;
    if (closes) {
      closed_entry = st.mean();
      closed_block = (seq + nodes.depth(k)) / kBlock;
    } else {
      store_state(bank0 + (k + 1) * bank_stride, dim, d, st);
    }
    if constexpr (kTree) {
      after[k] = st;
      entry[k * dim + d] = closes ? closed_entry : 0.0f;
      if (lk == 0 && d == 0) a.entry_blocks[row * kEntries + k] = closes ? closed_block : -1;
    }
  }
  if constexpr (!kTree) {
    entry[d] = closed_entry;
    if (lk == 0 && d == 0) a.entry_blocks[row] = closed_block;
  }
}

// ---------------------------------------------------------------------------------------------
// commit: bank0 = bank[accept_banks] (the chain: bank[accept]) where accept > 0 and
// (seq + accept) % 128 != 0.
//
// Work item (l, row, w): one 16-byte word of a slot's state (3*dim values; dim % 32 == 0 makes
// that a whole number of words for fp32 and bf16). The copy is bitwise.

struct alignas(16) Word16 {
  uint32_t x[4];
};

struct CommitArgs {
  Word16* state;
  const int32_t* seq_lens;
  const int32_t* accept_lens;
  const int32_t* accept_banks;  // [rows] or nullptr: the chain's bank (accept)
  const int32_t* slots;
  int64_t banks;
  int64_t slots_per_bank;
  int64_t words_per_slot;  // 3 * dim * sizeof(T) / 16
  int64_t layer0;
  int64_t rows;

  OC128_FN Rows call_rows() const { return Rows{slots, seq_lens, accept_lens, int32_t(banks - 1), slots_per_bank}; }
};

// `processed`: Rows::processed of the row (the backend computes it once per row).
OC128_FN void commit_word(const CommitArgs& a, int64_t l, int64_t row, int64_t w, bool processed) {
  if (!processed) return;
  const int32_t slot = a.slots[row], seq = a.seq_lens[row];
  const int32_t accept = a.accept_lens[row];
  const int32_t bank = committed_bank(seq, accept, a.accept_banks != nullptr ? a.accept_banks[row] : accept, a.banks);
  if (bank == 0) return;
  Word16* bank0 = a.state + ((a.layer0 + l) * a.banks * a.slots_per_bank + slot) * a.words_per_slot;
  bank0[w] = bank0[bank * a.slots_per_bank * a.words_per_slot + w];
}

}  // namespace oc128
