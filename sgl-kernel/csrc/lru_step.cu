// ESS's LRU step (ess.core.policy.lru_update, docs/design.md "Cache policy") as one CUDA kernel: one block per batch
// row, the row's slot table staged in shared memory, victims found by a select over a histogram instead of a bisection
// (docs/gpu.md, "The CUDA LRU step"). Results and tables equal the torch path's byte for byte (sink columns aside).
//
// The same source builds two ways (ess/core/kernels/lru_step_cuda.py):
//   nvcc            the GPU kernel, one block per row, NT = 512 threads;
//   g++ -DESS_EMULATE  a CPU emulation for the tests: a block's threads are std::threads meeting at a std::barrier
//                   (__syncthreads), warps are one thread wide (so the warp-level helpers are the identity), atomics
//                   are std::atomic_ref. Every block-level step of the kernel is the same code in both builds.
//
// Phases (a block barrier between each; values handed over in shared memory):
//   0. stage: each slot's position and a 32-bit word (its age key, or EMPTY); the own tokens and the entries (each
//      thread a contiguous run of entries, so that scans follow entry order) with their slot before the step;
//   1. claims: resident entries mark their slot PROT_S in shared memory; missing entries claim their position in the
//      position table with an atomic minimum of (INT32_MIN + entry index): the first entry of a position wins; a
//      resident own token's slot is marked PROT_OWN;
//   2. misses: the winners, compacted in entry order (a block scan); slot statistics (empties, protected, the age and
//      position ranges of the eviction candidates) in one block reduction;
//   3. select: if the misses and the own tokens needing a slot (V) exceed the empty slots (E), the (V - E)-th smallest
//      candidate key (age descending, then position ascending) by a histogram of 2048 bins over the key range,
//      narrowed pass by pass (a key range of 2^k needs ceil(k / 11) passes: 2 for 64 ages over 32K positions);
//   4. victims: the first V empty slots, or every empty slot and the candidates at or below the threshold, ranked in
//      slot order (a block scan) take the misses, then the own tokens; hit slots take the stamp;
//   5. outputs: every entry's slot read back from the position table.

#include <stdint.h>

#ifdef ESS_EMULATE
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#define ESS_KERNEL static
#define ESS_DEV static inline
#define ESS_BOUNDS(nt, blocks)
namespace emu {
thread_local int tid, bid;
thread_local std::barrier<>* bar;
thread_local unsigned char* smem;
}  // namespace emu
ESS_DEV int thread_id() { return emu::tid; }
ESS_DEV int block_id() { return emu::bid; }
ESS_DEV void sync_block() { emu::bar->arrive_and_wait(); }
ESS_DEV unsigned char* shared_base() { return emu::smem; }
template <class T> ESS_DEV void atomic_or(T* p, T v) { std::atomic_ref<T>(*p).fetch_or(v); }
template <class T> ESS_DEV void atomic_add(T* p, T v) { std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> ESS_DEV void atomic_min(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T cur = a.load();
  while (v < cur && !a.compare_exchange_weak(cur, v)) {
  }
}
template <class T> ESS_DEV T load_l2(const T* p) { return std::atomic_ref<T>(*const_cast<T*>(p)).load(std::memory_order_relaxed); }
ESS_DEV int clz64(unsigned long long x) { return __builtin_clzll(x); }
ESS_DEV long long global_timer() { return 0; }
constexpr int WARP = 1;
#else
#include <cuda_runtime.h>
#define ESS_KERNEL __global__
#define ESS_DEV __device__ __forceinline__
#define ESS_BOUNDS(nt, blocks) __launch_bounds__(nt, blocks)
ESS_DEV int thread_id() { return threadIdx.x; }
ESS_DEV int block_id() { return blockIdx.x; }
ESS_DEV void sync_block() { __syncthreads(); }
ESS_DEV unsigned char* shared_base() {
  extern __shared__ __align__(16) unsigned char ess_smem[];
  return ess_smem;
}
template <class T> ESS_DEV void atomic_or(T* p, T v) { atomicOr(p, v); }
template <class T> ESS_DEV void atomic_add(T* p, T v) { atomicAdd(p, v); }
template <class T> ESS_DEV void atomic_min(T* p, T v) { atomicMin(p, v); }
// Words another thread of the block wrote in this launch (atomics act in L2; L1 is not coherent within a launch).
template <class T> ESS_DEV T load_l2(const T* p) { return __ldcg(p); }
ESS_DEV int clz64(unsigned long long x) { return __clzll((long long)x); }
ESS_DEV long long global_timer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
constexpr int WARP = 32;
#endif

namespace ess_lru {

constexpr long long STAMP_MOD = 1LL << 28;  // ess.core.policy.STAMP_MOD
constexpr unsigned EMPTY = 1u << 28, PROT_S = 1u << 29, PROT_OWN = 1u << 30;  // flags above a slot's 28-bit age key
constexpr unsigned NOT_CANDIDATE = EMPTY | PROT_S | PROT_OWN;
constexpr int LOG_BINS = 11, BINS = 1 << LOG_BINS;
constexpr int MAX_OWN = 4;  // own tokens per row (MTP verify's query rows)
constexpr int CLAIM = INT32_MIN;
constexpr int PROFILE_TICKS = 8;
constexpr int ARGS = 26;  // the launcher's argument count (ess/core/kernels/lru_step_cuda.py passes them in this order)

struct Args {
  int* slot_pos;          // [R, C + 1]
  int* slot_stamp;        // [R, C + 1]
  int* pos_slot;          // [R, P + 1]
  const long long* req;   // [B]
  const int* sets;        // [B, K]
  const long long* own;   // [B, M]
  const void* stamp;      // [] int64, or int32 when stamp32
  const int* token_table; // [R, tt_stride] or null
  long long tt_stride;
  const int* num_rows;    // [] or null: rows at or past it are empty rows (CUDA-graph padding)
  int* attn;              // [B, K]
  unsigned char* hit;     // [B, K] bool
  int* miss_pos;          // [B, K]
  int* miss_slot;         // [B, K]
  int* miss_row;          // [B, K]
  int* own_out;           // [B, M]
  int* n_miss;            // [B]
  int* n_set;             // [B]
  unsigned* scratch;      // [B, C] when the slots do not fit shared memory, else null
  long long* prof;        // [B, 8] or null: thread 0's global timer at each phase boundary
  int B, K, C, P, M;
  int stamp32;
};

struct Red {  // slot statistics of phase 2
  int empty, prot_s, pmax;
  unsigned amin, amax;
};

ESS_DEV Red combine(Red a, Red b) {
  Red r;
  r.empty = a.empty + b.empty;
  r.prot_s = a.prot_s + b.prot_s;
  r.pmax = a.pmax > b.pmax ? a.pmax : b.pmax;
  r.amin = a.amin < b.amin ? a.amin : b.amin;
  r.amax = a.amax > b.amax ? a.amax : b.amax;
  return r;
}

// -- warp-level helpers: the identity in the emulation (one-thread warps) ------------------------------------------
ESS_DEV long long warp_inclusive_sum(long long v) {
#ifndef ESS_EMULATE
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    long long u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
#endif
  return v;
}

ESS_DEV Red warp_reduce(Red v) {
#ifndef ESS_EMULATE
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    Red o;
    o.empty = __shfl_xor_sync(0xffffffffu, v.empty, d);
    o.prot_s = __shfl_xor_sync(0xffffffffu, v.prot_s, d);
    o.pmax = __shfl_xor_sync(0xffffffffu, v.pmax, d);
    o.amin = __shfl_xor_sync(0xffffffffu, v.amin, d);
    o.amax = __shfl_xor_sync(0xffffffffu, v.amax, d);
    v = combine(v, o);
  }
#endif
  return v;
}

// One count into a shared histogram (bin < 0: none). Called by every thread of a warp at once (loops with
// block-uniform trip counts): lanes with the same bin add once (ties of ages are the common case).
ESS_DEV void hist_add(int* hist, int bin) {
#ifdef ESS_EMULATE
  if (bin >= 0) atomic_add(hist + bin, 1);
#else
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (bin >= 0 && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
#endif
}

// -- block-level helpers (the same code in both builds) --------------------------------------------------------------
template <int NT>
ESS_DEV long long block_exclusive_sum(long long v, long long* wsum, long long& total) {
  constexpr int NW = NT / WARP;
  const int tid = thread_id(), lane = tid % WARP, w = tid / WARP;
  const long long inc = warp_inclusive_sum(v);
  if (lane == WARP - 1) wsum[w] = inc;
  sync_block();
  long long before = 0, all = 0;
  for (int i = 0; i < NW; ++i) {
    const long long x = wsum[i];
    before += i < w ? x : 0;
    all += x;
  }
  sync_block();  // wsum is reused by the next call
  total = all;
  return before + inc - v;
}

template <int NT>
ESS_DEV Red block_reduce(Red v, Red* wred) {
  constexpr int NW = NT / WARP;
  const int tid = thread_id();
  v = warp_reduce(v);
  if (tid % WARP == 0) wred[tid / WARP] = v;
  sync_block();
  Red r = wred[0];
  for (int i = 1; i < NW; ++i) r = combine(r, wred[i]);
  sync_block();
  return r;
}

template <int NT>
struct Layout {  // shared memory: fixed part, then (staged) the slots' positions and keys
  static constexpr int NW = NT / WARP;
  static constexpr int HIST = 0;
  static constexpr int WSUM = HIST + BINS * 4;
  static constexpr int WRED = WSUM + ((NW * 8 + 15) / 16) * 16;
  static constexpr int MISC = WRED + ((NW * (int)sizeof(Red) + 15) / 16) * 16;
  static constexpr int FIXED = MISC + 64;  // misc: the selected bin's count below (8 B), its index, own slots
  static long long bytes(int C, bool staged) { return FIXED + (staged ? 8LL * C : 0); }
};

ESS_DEV long long mod_stamp(long long x) { return x & (STAMP_MOD - 1); }  // a power of two: the residue, also for x < 0

template <int NT, int EPT, bool STAGED>
ESS_KERNEL void ESS_BOUNDS(NT, 2) lru_step_kernel(Args a) {
  using L = Layout<NT>;
  const int b = block_id(), tid = thread_id();
  const int K = a.K, C = a.C, M = a.M;
  const long long out_row = (long long)b * K;
  if (a.prof && tid == 0) a.prof[b * PROFILE_TICKS + 0] = global_timer();

  // An empty row (no entry, no own token: CUDA-graph padding, or past num_rows) touches no table.
  auto empty_row = [&]() {
    for (int k = tid; k < K; k += NT) {
      a.attn[out_row + k] = -1;
      a.hit[out_row + k] = 0;
      a.miss_pos[out_row + k] = -1;
      a.miss_slot[out_row + k] = -1;
      a.miss_row[out_row + k] = -1;
    }
    if (tid < M) a.own_out[b * M + tid] = -1;
    if (tid == 0) a.n_miss[b] = a.n_set[b] = 0;
    if (a.prof && tid == 0)
      for (int i = 1; i < 7; ++i) a.prof[b * PROFILE_TICKS + i] = global_timer();
  };
  if (a.num_rows && b >= *a.num_rows) {
    empty_row();
    return;
  }

  const long long r = a.req[b];
  const long long t = mod_stamp(a.stamp32 ? *(const int*)a.stamp : *(const long long*)a.stamp);
  int* sp_row = a.slot_pos + r * (C + 1);
  int* st_row = a.slot_stamp + r * (C + 1);
  int* ps_row = a.pos_slot + r * (long long)(a.P + 1);
  const long long base = r * C;

  unsigned char* sm = shared_base();
  int* hist = (int*)(sm + L::HIST);
  long long* wsum = (long long*)(sm + L::WSUM);
  Red* wred = (Red*)(sm + L::WRED);
  long long* sel_before = (long long*)(sm + L::MISC);
  int* sel_bin = (int*)(sm + L::MISC + 8);
  int* own_new = (int*)(sm + L::MISC + 16);  // [MAX_OWN] the slot each own token needing one took
  const int* sp;                              // the slots' positions before the step
  unsigned* ag;                               // the slots' words: 28-bit age key (larger: newer) and flags
  if (STAGED) {
    int* s_sp = (int*)(sm + L::FIXED);
    sp = s_sp;
    ag = (unsigned*)(s_sp + C);
  } else {
    sp = sp_row;
    ag = a.scratch + (long long)b * C;
  }
  auto word = [&](int j) -> unsigned { return STAGED ? ag[j] : load_l2(ag + j); };

  // -- 0. stage ------------------------------------------------------------------------------------------------------
  long long own[MAX_OWN];
  int own_pre[MAX_OWN];
#pragma unroll
  for (int m = 0; m < MAX_OWN; ++m) {
    own[m] = m < M ? a.own[(long long)b * M + m] : -1;
    own_pre[m] = own[m] >= 0 ? ps_row[own[m]] : -1;
  }
  auto is_own = [&](int s) {
    bool o = false;
#pragma unroll
    for (int m = 0; m < MAX_OWN; ++m) o |= s >= 0 && own[m] == s;
    return o;
  };
  int s[EPT], pre[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int k = tid * EPT + i;
    s[i] = k < K ? a.sets[out_row + k] : -1;
    pre[i] = s[i] >= 0 ? ps_row[s[i]] : -1;
  }
  {
    long long live = 0, any;
    for (int i = 0; i < EPT; ++i) live += s[i] >= 0;
    for (int m = 0; m < MAX_OWN; ++m) live += own[m] >= 0;
    block_exclusive_sum<NT>(live, wsum, any);
    if (any == 0) {
      empty_row();
      return;
    }
  }
  for (int j = tid; j < C; j += NT) {
    const int p = sp_row[j];
    if (STAGED) ((int*)sp)[j] = p;
    ag[j] = p < 0 ? EMPTY : (unsigned)(STAMP_MOD - 1 - mod_stamp(t - st_row[j]));
  }
  if (tid == 0)
    for (int m = 0; m < MAX_OWN; ++m) own_new[m] = -1;
  sync_block();
  if (a.prof && tid == 0) a.prof[b * PROFILE_TICKS + 1] = global_timer();

  // -- 1. claims -----------------------------------------------------------------------------------------------------
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    if (s[i] < 0 || is_own(s[i])) continue;
    if (pre[i] >= 0)
      atomic_or(ag + pre[i], PROT_S);
    else
      atomic_min(ps_row + s[i], CLAIM + tid * EPT + i);
  }
  if (tid == 0)
    for (int m = 0; m < MAX_OWN; ++m)
      if (own[m] >= 0 && own_pre[m] >= 0) atomic_or(ag + own_pre[m], PROT_OWN);
  sync_block();
  if (a.prof && tid == 0) a.prof[b * PROFILE_TICKS + 2] = global_timer();

  // -- 2. misses, compacted in entry order; slot statistics ----------------------------------------------------------
  unsigned win = 0;
  int n_win = 0;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const bool w = s[i] >= 0 && pre[i] < 0 && !is_own(s[i]) && load_l2(ps_row + s[i]) == CLAIM + tid * EPT + i;
    win |= (unsigned)w << i;
    n_win += w;
  }
  Red st = {0, 0, -1, 0xffffffffu, 0u};
  for (int j = tid; j < C; j += NT) {
    const unsigned g = word(j);
    st.empty += (g & EMPTY) != 0;
    st.prot_s += (g & PROT_S) != 0;
    if (!(g & NOT_CANDIDATE)) {
      st.amin = g < st.amin ? g : st.amin;
      st.amax = g > st.amax ? g : st.amax;
      st.pmax = sp[j] > st.pmax ? sp[j] : st.pmax;
    }
  }
  st = block_reduce<NT>(st, wred);
  long long total;
  int rank = (int)block_exclusive_sum<NT>(n_win, wsum, total);
  const int n_miss = (int)total;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int k = tid * EPT + i;
    if ((win >> i) & 1) {
      a.miss_pos[out_row + rank] = s[i];
      a.miss_row[out_row + rank] = a.token_table ? a.token_table[r * a.tt_stride + s[i]] : -1;
      ++rank;
    }
    if (k >= n_miss && k < K) {  // the lists' tails
      a.miss_pos[out_row + k] = -1;
      a.miss_slot[out_row + k] = -1;
      a.miss_row[out_row + k] = -1;
    }
  }
  int n_need = 0;
  for (int m = 0; m < MAX_OWN; ++m) n_need += own[m] >= 0 && own_pre[m] < 0;
  const int V = n_miss + n_need;
  const int need = V - st.empty;  // candidates to evict
  if (a.prof && tid == 0) a.prof[b * PROFILE_TICKS + 3] = global_timer();

  // -- 3. select: the need-th smallest candidate key, key = (age key - min) * (max position + 1) + position -------------
  const unsigned amin = st.amin;
  const long long span_p = (long long)st.pmax + 1;
  auto key = [&](int j, unsigned g) { return (long long)(g - amin) * span_p + sp[j]; };
  long long lo = 0;
  if (need > 0) {
    long long hi = (long long)(st.amax - amin) * span_p + st.pmax;
    long long want = need;  // rank (1-based) of the threshold among the candidates in [lo, hi]
    constexpr int BPT = BINS / NT;  // bins per thread in the search
    while (hi > lo) {
      const int shift = (64 - clz64((unsigned long long)(hi - lo))) > LOG_BINS ? (64 - clz64((unsigned long long)(hi - lo))) - LOG_BINS : 0;
      const int nbins = (int)((hi - lo) >> shift) + 1;
      for (int i = tid; i < nbins; i += NT) hist[i] = 0;
      sync_block();
      for (int j0 = 0; j0 < C; j0 += NT) {
        const int j = j0 + tid;
        int bin = -1;
        if (j < C) {
          const unsigned g = word(j);
          if (!(g & NOT_CANDIDATE)) {
            const long long kj = key(j, g);
            if (kj >= lo && kj <= hi) bin = (int)((kj - lo) >> shift);
          }
        }
        hist_add(hist, bin);
      }
      sync_block();
      long long local = 0;
      for (int q = 0; q < BPT; ++q) {
        const int i = tid * BPT + q;
        local += i < nbins ? hist[i] : 0;
      }
      long long all;
      long long before = block_exclusive_sum<NT>(local, wsum, all);
      if (before < want && want <= before + local) {
        for (int q = 0; q < BPT; ++q) {
          const int h = tid * BPT + q < nbins ? hist[tid * BPT + q] : 0;
          if (before + h >= want) {
            *sel_bin = tid * BPT + q;
            *sel_before = before;
            break;
          }
          before += h;
        }
      }
      sync_block();
      lo += (long long)*sel_bin << shift;
      const long long top = lo + ((1LL << shift) - 1);
      hi = top < hi ? top : hi;
      want -= *sel_before;
      sync_block();  // sel_bin / sel_before are written again next pass
    }
  }
  const long long thr = need > 0 ? lo : -1;  // candidates with key <= thr are evicted
  if (a.prof && tid == 0) a.prof[b * PROFILE_TICKS + 4] = global_timer();

  // -- 4. victims, ranked in slot order (each thread a contiguous run of slots) ----------------------------------------
  const int per = ((C + NT - 1) / NT) | 1;  // odd: a warp's runs start in distinct shared-memory banks
  const int j0 = tid * per, j1 = j0 + per < C ? j0 + per : C;
  auto is_old = [&](int j, unsigned g) { return thr >= 0 && !(g & NOT_CANDIDATE) && key(j, g) <= thr; };
  long long counts = 0;  // empties in the low 32 bits, evicted candidates above
  for (int j = j0; j < j1; ++j) {
    const unsigned g = word(j);
    counts += (g & EMPTY) ? 1LL : (is_old(j, g) ? (1LL << 32) : 0);
  }
  long long before = block_exclusive_sum<NT>(counts, wsum, total);
  int e_before = (int)(before & 0xffffffffLL), o_before = (int)(before >> 32);
  for (int j = j0; j < j1; ++j) {
    const unsigned g = word(j);
    const bool empty = (g & EMPTY) != 0, old = is_old(j, g);
    const bool victim = (empty && e_before < V) || old;  // with evictions every empty slot is a victim (E < V)
    const int v = e_before + o_before;
    e_before += empty;
    o_before += old;
    if (g & (PROT_S | PROT_OWN)) st_row[j] = (int)t;  // a hit (or a resident own token): the step's stamp
    if (!victim) continue;
    if (old) ps_row[sp[j]] = -1;  // evicted: neither in the set nor an own token
    long long p_new;
    if (v < n_miss) {
      p_new = load_l2(a.miss_pos + out_row + v);
      a.miss_slot[out_row + v] = (int)(base + j);
    } else {  // the victims past the misses go to the own tokens needing a slot, in their order
      int q = v - n_miss, m_new = 0;
      p_new = -1;
#pragma unroll
      for (int m = 0; m < MAX_OWN; ++m) {  // constant indices: own[] stays in registers
        const bool needs = own[m] >= 0 && own_pre[m] < 0;
        if (needs && q == 0) {
          p_new = own[m];
          m_new = m;
        }
        q -= needs;
      }
      own_new[m_new] = j;
    }
    ps_row[p_new] = j;
    sp_row[j] = (int)p_new;
    st_row[j] = (int)t;
  }
  sync_block();
  if (a.prof && tid == 0) a.prof[b * PROFILE_TICKS + 5] = global_timer();

  // -- 5. outputs ------------------------------------------------------------------------------------------------------
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int k = tid * EPT + i;
    if (k >= K) break;
    const bool entry = s[i] >= 0;
    a.attn[out_row + k] = entry ? (int)(base + load_l2(ps_row + s[i])) : -1;
    a.hit[out_row + k] = entry && (pre[i] >= 0 || is_own(s[i]));
  }
#pragma unroll
  for (int m = 0; m < MAX_OWN; ++m) {
    if (m == tid && m < M) {
      const int slot = own_pre[m] >= 0 ? own_pre[m] : own_new[m];
      a.own_out[(long long)b * M + m] = own[m] >= 0 ? (int)(base + slot) : -1;
    }
  }
  if (tid == 0) {
    a.n_miss[b] = n_miss;
    a.n_set[b] = n_miss + st.prot_s;
  }
  if (a.prof && tid == 0) a.prof[b * PROFILE_TICKS + 6] = global_timer();
}

}  // namespace ess_lru

// -- launchers: `ess_lru_step(args, nargs, stream)`, args in Args' field order as 64-bit words --------------------------

#ifdef ESS_EMULATE
#ifndef ESS_EMU_THREADS
#define ESS_EMU_THREADS 32  // threads per emulated block (512, the GPU's, in one test)
#endif
static constexpr int NT_LAUNCH = ESS_EMU_THREADS;
#else
static constexpr int NT_LAUNCH = 512;
#endif

static ess_lru::Args unpack(const long long* w) {
  ess_lru::Args a;
  a.slot_pos = (int*)w[0];
  a.slot_stamp = (int*)w[1];
  a.pos_slot = (int*)w[2];
  a.req = (const long long*)w[3];
  a.sets = (const int*)w[4];
  a.own = (const long long*)w[5];
  a.stamp = (const void*)w[6];
  a.token_table = (const int*)w[7];
  a.tt_stride = w[8];
  a.num_rows = (const int*)w[9];
  a.attn = (int*)w[10];
  a.hit = (unsigned char*)w[11];
  a.miss_pos = (int*)w[12];
  a.miss_slot = (int*)w[13];
  a.miss_row = (int*)w[14];
  a.own_out = (int*)w[15];
  a.n_miss = (int*)w[16];
  a.n_set = (int*)w[17];
  a.scratch = (unsigned*)w[18];
  a.prof = (long long*)w[19];
  a.B = (int)w[20];
  a.K = (int)w[21];
  a.C = (int)w[22];
  a.P = (int)w[23];
  a.M = (int)w[24];
  a.stamp32 = (int)w[25];
  return a;
}

template <int EPT, bool STAGED>
static int launch(const ess_lru::Args& a, void* stream);

#ifdef ESS_EMULATE
template <int EPT, bool STAGED>
static int launch(const ess_lru::Args& a, void*) {
  const long long bytes = ess_lru::Layout<NT_LAUNCH>::bytes(a.C, STAGED);
  std::vector<unsigned char> smem(bytes + 16);
  for (int b = 0; b < a.B; ++b) {  // blocks one after another (rows are independent)
    std::memset(smem.data(), 0xAB, smem.size());  // stale bytes, as a GPU's shared memory holds
    std::barrier<> bar(NT_LAUNCH);
    std::vector<std::thread> threads;
    for (int t = 0; t < NT_LAUNCH; ++t)
      threads.emplace_back([&, t] {
        emu::tid = t;
        emu::bid = b;
        emu::bar = &bar;
        emu::smem = smem.data();
        ess_lru::lru_step_kernel<NT_LAUNCH, EPT, STAGED>(a);
      });
    for (auto& th : threads) th.join();
  }
  return 0;
}
#else
template <int EPT, bool STAGED>
static int launch(const ess_lru::Args& a, void* stream) {
  const long long bytes = ess_lru::Layout<NT_LAUNCH>::bytes(a.C, STAGED);
  auto kernel = ess_lru::lru_step_kernel<NT_LAUNCH, EPT, STAGED>;
  // Raised once per device and size (the first call, eager, before any graph capture), not at every launch.
  static long long allowed[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  long long& limit = allowed[dev & 63];
  if (bytes > 48 * 1024 && bytes > limit) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e != cudaSuccess) return (int)e;
    limit = bytes;
  }
  kernel<<<a.B, NT_LAUNCH, bytes, (cudaStream_t)stream>>>(a);
  return (int)cudaGetLastError();
}
#endif

template <bool STAGED>
static int dispatch(const ess_lru::Args& a, void* stream) {
  const int ept = (a.K + NT_LAUNCH - 1) / NT_LAUNCH;
  if (ept <= 1) return launch<1, STAGED>(a, stream);
  if (ept <= 2) return launch<2, STAGED>(a, stream);
  if (ept <= 4) return launch<4, STAGED>(a, stream);
  if (ept <= 8) return launch<8, STAGED>(a, stream);
  if (ept <= 12) return launch<12, STAGED>(a, stream);
  if (ept <= 16) return launch<16, STAGED>(a, stream);
  return -2;
}

extern "C" {

// Entries per row the kernel takes (K), own tokens per row (M); -1 codes below name the violated one.
int ess_lru_max_entries() { return 16 * NT_LAUNCH; }
int ess_lru_max_own() { return ess_lru::MAX_OWN; }
int ess_lru_threads() { return NT_LAUNCH; }

// The most slots per row that the kernel stages in shared memory on this device (beyond: the caller passes scratch).
int ess_lru_max_staged_slots(int device) {
#ifdef ESS_EMULATE
  (void)device;
  return 1 << 30;
#else
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
  const int fixed = ess_lru::Layout<NT_LAUNCH>::FIXED;
  return optin > fixed ? (optin - fixed) / 8 : 0;
#endif
}

// 0: launched; -1: wrong argument count; -2: K too large; -3: M too large; > 0: a CUDA error code.
int ess_lru_step(const long long* words, int nwords, void* stream) {
  if (nwords != ess_lru::ARGS) return -1;
  const ess_lru::Args a = unpack(words);
  if (a.K > ess_lru_max_entries()) return -2;
  if (a.M > ess_lru::MAX_OWN || a.M < 1) return -3;
  if (a.B == 0) return 0;
  return a.scratch ? dispatch<false>(a, stream) : dispatch<true>(a, stream);
}

}  // extern "C"
