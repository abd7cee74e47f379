"""The C++ source of :mod:`pdserve.workers.engine.model.paged_kernel` (its design is described
there), compiled at first use with ``torch.utils.cpp_extension.load_inline``. It registers
``torch.ops.pdserve_paged.varlen`` (attention over the pool read in place) and
``torch.ops.pdserve_paged.store_attend`` (the step's K/V written into their pool rows, then
``varlen`` over every row of the step, in one call: the compiled decode step's path).
"""

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

namespace {
using Vec = at::vec::Vectorized<float>;
using at::vec::fmadd;
constexpr int64_t VS = Vec::size();
constexpr int64_t KC = 64;                 // keys per chunk
constexpr int64_t MIN_PART = 256;          // fewest keys per context partition
constexpr int64_t LANES_MIN = VS * 3 / 4;  // fewest query vectors of a lanes item
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
enum Kind { F32, BF16, F16, E4M3, E5M2 };

// n values of kind K at src -> float
template <Kind K>
inline void to_float(const void* src, float* dst, int64_t n) {
  int64_t d = 0;
  if constexpr (K == F32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (K == BF16 || K == F16) {
    using T = std::conditional_t<K == BF16, c10::BFloat16, c10::Half>;
    const T* s = static_cast<const T*>(src);
    for (Vec v; d + VS <= n; d += VS) at::vec::load_to_float<T>(s + d, v), v.store(dst + d);
    for (; d < n; ++d) dst[d] = static_cast<float>(s[d]);
  } else {  // FP8's fields moved into float32's: exact, subnormals by subtracting 2^(1-bias)
    const uint8_t* s = static_cast<const uint8_t*>(src);
    constexpr uint32_t SH = K == E4M3 ? 20 : 21, BIAS = K == E4M3 ? 7 : 15;
    constexpr uint32_t EXP = K == E4M3 ? 0x78 : 0x7C;
    constexpr float MAGIC = K == E4M3 ? 0.015625f : 6.103515625e-05f;
    for (int64_t i = 0; i < n; ++i) {  // vectorized by the compiler
      const uint32_t b = s[i], e = b & EXP, sub = e == 0;
      uint32_t u = ((b & 0x7F) << SH) + ((127 - BIAS + sub) << 23);
      if (K == E5M2 && e == EXP) u = 0x7F800000u | (b & 3) << 21;  // inf, NaN
      float f;
      std::memcpy(&f, &u, sizeof f);
      f -= sub ? MAGIC : 0.f;
      if (K == E4M3 && (b & 0x7F) == 0x7F) f = NAN;
      dst[i] = b & 0x80 ? -f : f;
    }
  }
}

// ---- few query vectors (decode rows): a dot product per key, the query in registers ----
template <int HDV>  // head size / VS; 0: any head size
void qk_dot(const float* q, const float* const* k, int64_t a, int64_t b, float* s, int64_t hd) {
  Vec qv[HDV ? HDV : 1];
  for (int i = 0; i < HDV; ++i) qv[i] = Vec::loadu(q + i * VS);
  for (int64_t j = a; j < b; ++j) {
    Vec s0(0.f), s1(0.f);
    int64_t d = HDV * VS;
    for (int i = 0; i < HDV; i += 2) s0 = fmadd(qv[i], Vec::loadu(k[j] + i * VS), s0);
    for (int i = 1; i < HDV; i += 2) s1 = fmadd(qv[i], Vec::loadu(k[j] + i * VS), s1);
    if constexpr (HDV == 0)
      for (d = 0; d + VS <= hd; d += VS) s0 = fmadd(Vec::loadu(q + d), Vec::loadu(k[j] + d), s0);
    float t = (s0 + s1).reduce_add();
    for (; d < hd; ++d) t += q[d] * k[j][d];
    s[j] = t;
  }
}

// acc[0:hd] += sum_{j in [a, b)} w[j] * v[j][0:hd], the accumulators in registers
template <int HDV>
void pv_dot(float* acc, const float* w, const float* const* v, int64_t a, int64_t b, int64_t hd) {
  constexpr int NV = HDV ? HDV : 1;  // any head size: a vector at a time, then scalars
  int64_t d = 0;
  for (; d + NV * VS <= hd; d += NV * VS) {
    Vec av[NV];
    for (int i = 0; i < NV; ++i) av[i] = Vec::loadu(acc + d + i * VS);
    for (int64_t j = a; j < b; ++j)
      for (int i = 0; i < NV; ++i) av[i] = fmadd(Vec(w[j]), Vec::loadu(v[j] + d + i * VS), av[i]);
    for (int i = 0; i < NV; ++i) av[i].store(acc + d + i * VS);
  }
  for (; d < hd; ++d)
    for (int64_t j = a; j < b; ++j) acc[d] += w[j] * v[j][d];
}

// ---- many query vectors (prefill tiles): W = MV * VS query vectors across the SIMD lanes ----
// st[j][0:W] = sum_d k[j][d] * qt[d][0:W] for keys j < n, four keys at a time
template <int MV>
void qk_lanes(const float* qt, const float* const* k, int64_t n, float* st, int64_t hd) {
  constexpr int64_t W = MV * VS;
  for (int64_t j = 0; j < n; j += 4) {
    const int64_t nk = std::min<int64_t>(4, n - j);
    const float* kr[4];
    for (int x = 0; x < 4; ++x) kr[x] = k[j + std::min<int64_t>(x, nk - 1)];
    Vec acc[4][MV];  // Vectorized() is zeros
    for (int64_t d = 0; d < hd; ++d)
      for (int m = 0; m < MV; ++m) {
        const Vec qv = Vec::loadu(qt + d * W + m * VS);
        for (int x = 0; x < 4; ++x) acc[x][m] = fmadd(Vec(kr[x][d]), qv, acc[x][m]);
      }
    for (int x = 0; x < nk; ++x)
      for (int m = 0; m < MV; ++m) acc[x][m].store(st + (j + x) * W + m * VS);
  }
}

// at[d][0:W] += sum_{j < n} v[j][d] * pt[j][0:W], four dimensions at a time
template <int MV>
void pv_lanes(float* at, const float* pt, const float* const* v, int64_t n, int64_t hd) {
  constexpr int64_t W = MV * VS;
  for (int64_t d = 0; d < hd; d += 4) {
    const int64_t nd = std::min<int64_t>(4, hd - d);
    Vec acc[4][MV];
    for (int x = 0; x < nd; ++x)
      for (int m = 0; m < MV; ++m) acc[x][m] = Vec::loadu(at + (d + x) * W + m * VS);
    for (int64_t j = 0; j < n; ++j)
      for (int m = 0; m < MV; ++m) {
        const Vec pv = Vec::loadu(pt + j * W + m * VS);
        for (int x = 0; x < 4; ++x)
          if (x < nd) acc[x][m] = fmadd(Vec(v[j][d + x]), pv, acc[x][m]);
      }
    for (int x = 0; x < nd; ++x)
      for (int m = 0; m < MV; ++m) acc[x][m].store(at + (d + x) * W + m * VS);
  }
}

// online softmax of a chunk's scores st[j < n][0:W], lane-wise: running max m and sum l,
// accumulators at[hd][W] rescaled, st becomes the weights. A lane with every key masked so
// far keeps max -inf and weights 0 (its exponents are taken against 0, not -inf).
template <int MV>
void softmax_lanes(float* st, int64_t n, float* m, float* l, float* at, int64_t hd) {
  constexpr int64_t W = MV * VS;
  Vec mx[MV], base[MV], alpha[MV], sum[MV];  // Vectorized() is zeros
  for (int i = 0; i < MV; ++i) mx[i] = Vec::loadu(m + i * VS);
  for (int64_t j = 0; j < n; ++j)
    for (int i = 0; i < MV; ++i) mx[i] = at::vec::maximum(mx[i], Vec::loadu(st + j * W + i * VS));
  for (int i = 0; i < MV; ++i) {
    base[i] = Vec::blendv(mx[i], Vec(0.f), mx[i] == Vec(NEG_INF));
    alpha[i] = (Vec::loadu(m + i * VS) - base[i]).exp_u20();
    mx[i].store(m + i * VS);
  }
  for (int64_t j = 0; j < n; ++j)
    for (int i = 0; i < MV; ++i) {
      const Vec e = (Vec::loadu(st + j * W + i * VS) - base[i]).exp_u20();
      e.store(st + j * W + i * VS);
      sum[i] = sum[i] + e;
    }
  for (int i = 0; i < MV; ++i) (Vec::loadu(l + i * VS) * alpha[i] + sum[i]).store(l + i * VS);
  for (int64_t i = 0; i < hd * W; i += VS)  // at[d][lane] *= alpha[lane]
    (Vec::loadu(at + i) * alpha[i % W / VS]).store(at + i);
}

struct Ops {  // the kernels for the head size (dot path) and for MV lane vectors
  decltype(&qk_dot<0>) qk = qk_dot<0>;
  decltype(&pv_dot<0>) pv = pv_dot<0>;
  decltype(&qk_lanes<1>) qkl[4] = {qk_lanes<1>, qk_lanes<2>, qk_lanes<3>, qk_lanes<4>};
  decltype(&pv_lanes<1>) pvl[4] = {pv_lanes<1>, pv_lanes<2>, pv_lanes<3>, pv_lanes<4>};
  decltype(&softmax_lanes<1>) sml[4] = {softmax_lanes<1>, softmax_lanes<2>, softmax_lanes<3>,
                                        softmax_lanes<4>};
  explicit Ops(int64_t hd) {
    if (hd == 2 * VS) qk = qk_dot<2>, pv = pv_dot<2>;
    if (hd == 4 * VS) qk = qk_dot<4>, pv = pv_dot<4>;
    if (hd == 8 * VS) qk = qk_dot<8>, pv = pv_dot<8>;
    if (hd == 16 * VS) qk = qk_dot<16>, pv = pv_dot<16>;
  }
};

struct Params {
  const char* q;
  char* out;
  at::ScalarType qt;
  int64_t qesz, H, hd, G;
  const char* cache;  // strides in elements, sizes in bytes
  int64_t cesz, s_block, s_kv, s_tok, s_head, tpb;
  const int64_t *table, table_stride, *qstart, *ctx;
  float scale, softcap;
  int64_t window;
  const float* sinks;
  float* partial;
  Ops ops;
  void (*load_q)(const void*, float*, int64_t);
  const char* query_at(int64_t t, int64_t h) const { return q + (t * H + h) * hd * qesz; }
  void store(const float* src, float mul, int64_t t, int64_t h) const {  // output row (t, h)
    char* dst = out + (t * H + h) * hd * qesz;
    for (int64_t d = 0; d < hd; ++d) {
      const float x = src[d] * mul;
      if (qt == at::kBFloat16) reinterpret_cast<c10::BFloat16*>(dst)[d] = c10::BFloat16(x);
      else if (qt == at::kHalf) reinterpret_cast<c10::Half*>(dst)[d] = c10::Half(x);
      else reinterpret_cast<float*>(dst)[d] = x;
    }
  }
};

// query rows [r0, r1) of sequence s (0-based within s), kv head g, keys [k0, k1); query vector
// mi is row r0 + mi / G of head g * G + mi % G. slot < 0: write the output, else the partial
// results (max, sum, accumulators of each query vector) at partial + slot
struct Item { int64_t s, g, r0, r1, k0, k1, slot, cost; };
struct Split { int64_t s, g, r0, r1, slot, parts; };  // an item in parts (slot: the first's)

struct Scratch {  // per thread, grown once
  std::vector<float> q, acc, m, l, pos, lo, s, kb, vb, tmp, rec, sum;
  void fit(int64_t rows, int64_t hd) {
    for (auto* v : {&q, &acc}) v->resize(std::max<size_t>(v->size(), rows * hd));
    for (auto* v : {&m, &l, &pos, &lo}) v->resize(std::max<size_t>(v->size(), rows));
    s.resize(std::max<size_t>(s.size(), KC * rows));
    for (auto* v : {&kb, &vb}) v->resize(std::max<size_t>(v->size(), KC * hd));
    for (auto* v : {&tmp, &rec, &sum}) v->resize(std::max<size_t>(v->size(), hd + 2));
  }
};
thread_local Scratch tls;

// query vector mi of (sequence s, rows from r0, kv head g) from its parts' results (max, sum,
// accumulators; rec_len apart) combined by their log-sum-exp with the sink, to the output
void emit(const Params& p, int64_t s, int64_t r0, int64_t g, int64_t mi, const float* base,
          int64_t parts, int64_t rec_len) {
  const int64_t hd = p.hd, h = g * p.G + mi % p.G;
  float* acc = tls.sum.data();
  float m = p.sinks ? p.sinks[h] : NEG_INF;
  for (int64_t k = 0; k < parts; ++k) m = std::max(m, base[k * rec_len]);
  float den = p.sinks ? std::exp(p.sinks[h] - m) : 0.f;
  std::fill(acc, acc + hd, 0.f);
  for (int64_t k = 0; k < parts; ++k) {
    const float* rec = base + k * rec_len;
    if (rec[1] == 0.f) continue;  // no key of this part visible to mi
    const float w = std::exp(rec[0] - m);
    den += rec[1] * w;
    for (int64_t d = 0; d < hd; ++d) acc[d] += w * rec[2 + d];
  }
  p.store(acc, 1.f / den, p.qstart[s] + r0 + mi / p.G, h);
}

template <Kind K>
void run_item(const Params& p, const Item& it) {
  const int64_t G = p.G, hd = p.hd, nr = it.r1 - it.r0, M = nr * G;
  const bool lanes = M >= LANES_MIN && M <= 4 * VS;
  const int64_t MV = (M + VS - 1) / VS, W = lanes ? MV * VS : M;
  Scratch& sc = tls;
  sc.fit(W, hd);
  float *q = sc.q.data(), *acc = sc.acc.data(), *mx = sc.m.data(), *l = sc.l.data();
  float *s = sc.s.data(), *tmp = sc.tmp.data();
  const int64_t q0 = p.qstart[it.s], qlen = p.qstart[it.s + 1] - q0, ctx = p.ctx[it.s];
  const int64_t first = ctx - qlen + it.r0, last = first + nr - 1;  // query positions
  std::fill(q, q + W * hd, 0.f), std::fill(acc, acc + W * hd, 0.f), std::fill(l, l + W, 0.f);
  std::fill(mx, mx + W, NEG_INF), std::fill(sc.pos.data(), sc.pos.data() + W, 0.f);
  // query vectors times scale: q[mi][hd] (dot path) or q[hd][W] (lanes, padding lanes 0)
  for (int64_t mi = 0; mi < M; ++mi) {
    p.load_q(p.query_at(q0 + it.r0 + mi / G, it.g * G + mi % G), tmp, hd);
    for (int64_t d = 0; d < hd; ++d) (lanes ? q[d * W + mi] : q[mi * hd + d]) = tmp[d] * p.scale;
    sc.pos[mi] = float(first + mi / G);
    sc.lo[mi] = p.window > 0 ? sc.pos[mi] - float(p.window - 1) : 0.f;
  }
  std::fill(sc.lo.data() + M, sc.lo.data() + W, 0.f);
  // K rows of keys [c0, c0 + n) through the block table (V rows at + v_off)
  const int64_t* table = p.table + it.s * p.table_stride;
  const int64_t row_bytes = hd * p.cesz, v_off = p.s_kv * p.cesz;
  const char *cur[KC], *next[KC];
  auto key_rows = [&](int64_t c0, const char** rows, bool prefetch) {
    int64_t blk = c0 / p.tpb, off = c0 % p.tpb;
    for (int64_t j = 0; j < std::min(KC, it.k1 - c0); ++j) {
      rows[j] = p.cache + (table[blk] * p.s_block + off * p.s_tok + it.g * p.s_head) * p.cesz;
      for (int64_t b = 0; prefetch && b < row_bytes; b += 64)
        __builtin_prefetch(rows[j] + b), __builtin_prefetch(rows[j] + v_off + b);
      if (++off == p.tpb) off = 0, ++blk;
    }
  };
  key_rows(it.k0, next, !lanes);
  const float *krow[KC], *vrow[KC];
  for (int64_t c0 = it.k0; c0 < it.k1; c0 += KC) {
    const int64_t n = std::min(KC, it.k1 - c0);
    std::copy(next, next + n, cur);
    if (c0 + KC < it.k1) key_rows(c0 + KC, next, !lanes);  // decode streams from DRAM
    for (int64_t j = 0; j < n; ++j) {  // float32 rows in place, others converted
      krow[j] = K == F32 ? reinterpret_cast<const float*>(cur[j]) : &sc.kb[j * hd];
      vrow[j] = K == F32 ? reinterpret_cast<const float*>(cur[j] + v_off) : &sc.vb[j * hd];
      if constexpr (K != F32)
        to_float<K>(cur[j], &sc.kb[j * hd], hd), to_float<K>(cur[j] + v_off, &sc.vb[j * hd], hd);
    }
    const Vec cap(p.softcap), inv(1.f / p.softcap);
    if (lanes) {
      p.ops.qkl[MV - 1](q, krow, n, s, hd);
      for (int64_t i = 0; p.softcap > 0.f && i < n * W; i += VS)
        (cap * (Vec::loadu(s + i) * inv).tanh()).store(s + i);
      if (c0 + n - 1 > first || (p.window > 0 && c0 < last - p.window + 1))  // mask
        for (int64_t j = 0; j < n; ++j)
          for (int64_t i = 0; i < W; i += VS) {
            const Vec key(float(c0 + j)), x = Vec::loadu(s + j * W + i);
            const Vec ok = (key <= Vec::loadu(&sc.pos[i])) & (key >= Vec::loadu(&sc.lo[i]));
            Vec::blendv(Vec(NEG_INF), x, ok).store(s + j * W + i);
          }
      p.ops.sml[MV - 1](s, n, mx, l, acc, hd);
      p.ops.pvl[MV - 1](acc, s, vrow, n, hd);
      continue;
    }
    const int64_t npad = (n + VS - 1) / VS * VS;
    for (int64_t mi = 0; mi < M; ++mi) {
      const int64_t pos = first + mi / G;
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
      const int64_t a = std::max(lo, c0) - c0, b = std::min(pos + 1, c0 + n) - c0;
      if (a >= b) continue;  // no key of this chunk visible
      p.ops.qk(q + mi * hd, krow, a, b, s, hd);
      for (int64_t j = 0; p.softcap > 0.f && j < npad; j += VS)
        (cap * (Vec::loadu(s + j) * inv).tanh()).store(s + j);
      std::fill(s, s + a, NEG_INF), std::fill(s + b, s + npad, NEG_INF);
      Vec vmax(NEG_INF), vsum(0.f);
      for (int64_t j = 0; j < npad; j += VS) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
      const float mnew = std::max(mx[mi], vmax.reduce_max()), alpha = std::exp(mx[mi] - mnew);
      for (int64_t j = 0; j < npad; j += VS)  // the weights, and their sum
        (Vec::loadu(s + j) - Vec(mnew)).exp_u20().store(s + j), vsum = vsum + Vec::loadu(s + j);
      float* ar = acc + mi * hd;
      for (int64_t d = 0; alpha != 1.f && d < hd; ++d) ar[d] *= alpha;
      l[mi] = l[mi] * alpha + vsum.reduce_add();
      mx[mi] = mnew;
      p.ops.pv(ar, s, vrow, a, b, hd);
    }
  }
  for (int64_t mi = 0; mi < M; ++mi) {  // the partial result, or the output
    float* rec = it.slot >= 0 ? p.partial + it.slot + mi * (hd + 2) : sc.rec.data();
    rec[0] = mx[mi], rec[1] = l[mi];
    for (int64_t d = 0; d < hd; ++d) rec[2 + d] = lanes ? acc[d * W + mi] : acc[mi * hd + d];
    if (it.slot < 0) emit(p, it.s, it.r0, it.g, mi, rec, 1, 0);
  }
}

template <typename F>
void run_dynamic(int64_t n, const F& f) {  // items taken in order by whichever thread is free
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  auto loop = [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
  };
  if (nt <= 1) loop(0, 1);
  else at::parallel_for(0, nt, 1, loop);
}

template <Kind K>
void run_all(const Params& p, const std::vector<Item>& items, const std::vector<Split>& splits) {
  run_dynamic((int64_t)items.size(), [&](int64_t i) { run_item<K>(p, items[i]); });
  run_dynamic((int64_t)splits.size(), [&](int64_t i) {
    const Split& sp = splits[i];
    const int64_t M = (sp.r1 - sp.r0) * p.G, rec_len = M * (p.hd + 2);
    tls.fit(1, p.hd);
    for (int64_t mi = 0; mi < M; ++mi)
      emit(p, sp.s, sp.r0, sp.g, mi, p.partial + sp.slot + mi * (p.hd + 2), sp.parts, rec_len);
  });
}

void varlen(at::Tensor out, const at::Tensor& query, const at::Tensor& cache,
            const at::Tensor& block_tables, const at::Tensor& query_start,
            const at::Tensor& ctx_lens, double scale, int64_t window, double softcap,
            const std::optional<at::Tensor>& sinks) {
  const int64_t T = query.size(0), H = query.size(1), hd = query.size(2);
  const int64_t nblocks = cache.size(0), tpb = cache.size(2), kvh = cache.size(3);
  const int64_t S = ctx_lens.size(0), width = block_tables.size(1), G = H / kvh;
  TORCH_CHECK_VALUE(query.is_contiguous() && out.is_contiguous() && cache.stride(4) == 1 &&
                    block_tables.stride(1) == 1 && query_start.is_contiguous() &&
                    ctx_lens.is_contiguous(), "paged attention: layout");
  const int64_t *qs = query_start.data_ptr<int64_t>(), *ctx = ctx_lens.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(qs[0] == 0 && qs[S] == T, "query_start runs from ", qs[0], " to ", qs[S],
                    ", not from 0 to ", T);
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t qlen = qs[s + 1] - qs[s];
    TORCH_CHECK_VALUE(qlen >= 0 && qlen <= ctx[s] && ctx[s] <= width * tpb, "sequence ", s,
                      ": ", qlen, " query rows, context ", ctx[s], ", block table of ", width,
                      " blocks of ", tpb, " tokens");
    if (qlen == 0) continue;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx[s] - qlen - window + 1) : 0;
    for (int64_t b = lo / tpb; b < (ctx[s] + tpb - 1) / tpb; ++b) {
      const int64_t id = table[s * block_tables.stride(0) + b];
      TORCH_CHECK_VALUE(id >= 0 && id < nblocks, "sequence ", s, ": block ", b, " is ", id,
                        ", not in [0, ", nblocks, ")");
    }
    int64_t rows = G > 4 * VS ? 1 : qlen;  // few query vectors: one dot-path item per kv head
    if (qlen * G >= LANES_MIN && G <= 4 * VS) {  // else lanes items of at most 4 * VS vectors
      const int64_t tiles = (qlen + 4 * VS / G - 1) / (4 * VS / G);
      rows = (qlen + tiles - 1) / tiles;
    }
    for (int64_t r0 = 0; r0 < qlen; r0 += rows) {
      const int64_t r1 = std::min(qlen, r0 + rows), end = ctx[s] - qlen + r1;
      const int64_t k0 = window > 0 ? std::max<int64_t>(0, end - (r1 - r0) - window + 1) : 0;
      for (int64_t g = 0; g < kvh; ++g)
        items.push_back({s, g, r0, r1, k0, end, -1, (end - k0) * (r1 - r0)});
    }
  }
  // fewer items than twice the threads: long contexts in parts (flash-decoding)
  const int64_t threads = at::get_num_threads(), n_items = (int64_t)items.size();
  std::vector<Split> splits;
  int64_t slots = 0;
  if (threads > 1 && n_items > 0 && n_items < 2 * threads) {
    const int64_t want = (4 * threads + n_items - 1) / n_items;
    std::vector<Item> parted;
    for (const Item& it : items) {
      const int64_t span = it.k1 - it.k0, parts = std::min(want, span / MIN_PART);
      if (parts < 2) { parted.push_back(it); continue; }
      const int64_t len = (span + parts - 1) / parts, rec = (it.r1 - it.r0) * G * (hd + 2);
      splits.push_back({it.s, it.g, it.r0, it.r1, slots, parts});
      for (int64_t k = 0; k < parts; ++k, slots += rec) {  // a part past the end: no keys
        const int64_t c = it.k0 + k * len, e = std::min(it.k1, c + len);
        parted.push_back({it.s, it.g, it.r0, it.r1, c, e, slots, (e - c) * (it.r1 - it.r0)});
      }
    }
    items.swap(parted);
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  at::Tensor partial = at::empty({std::max<int64_t>(slots, 1)}, at::kFloat);
  const Params p{static_cast<const char*>(query.data_ptr()), static_cast<char*>(out.data_ptr()),
                 query.scalar_type(), (int64_t)query.element_size(), H, hd, G,
                 static_cast<const char*>(cache.data_ptr()), (int64_t)cache.element_size(),
                 cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), tpb,
                 table, block_tables.stride(0), qs, ctx, (float)scale, (float)softcap, window,
                 sinks ? sinks->data_ptr<float>() : nullptr, partial.data_ptr<float>(), Ops(hd),
                 query.scalar_type() == at::kBFloat16 ? to_float<BF16>
                 : query.scalar_type() == at::kHalf   ? to_float<F16> : to_float<F32>};
  switch (cache.scalar_type()) {
    case at::kFloat: return run_all<F32>(p, items, splits);
    case at::kBFloat16: return run_all<BF16>(p, items, splits);
    case at::kHalf: return run_all<F16>(p, items, splits);
    case at::kFloat8_e4m3fn: return run_all<E4M3>(p, items, splits);
    case at::kFloat8_e5m2: return run_all<E5M2>(p, items, splits);
    default: TORCH_CHECK_VALUE(false, "paged attention: cache dtype ", cache.scalar_type());
  }
}

// the step's K/V into their pool rows: key/value [1, kvh, T, hd] (last dim contiguous) of the
// cache's dtype; k_slots/v_slots [T] int64, rows of the layer's pool viewed as
// [num_blocks * 2 * tpb, kvh, hd] (the view need not exist: the cache's strides are used)
void store(const at::Tensor& cache, const at::Tensor& key, const at::Tensor& value,
           const at::Tensor& k_slots, const at::Tensor& v_slots) {
  const int64_t nb = cache.size(0), tpb = cache.size(2), kvh = cache.size(3), hd = cache.size(4);
  const int64_t T = key.size(2), rows = nb * 2 * tpb, es = cache.element_size();
  TORCH_CHECK_VALUE(cache.dim() == 5 && cache.size(1) == 2 && cache.stride(4) == 1,
                    "store: cache layout");
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == 1 && t->size(1) == kvh && t->size(2) == T &&
                      t->size(3) == hd && t->stride(3) == 1 &&
                      t->scalar_type() == cache.scalar_type(), "store: K/V ", t->sizes(),
                      " of ", t->scalar_type(), " for a cache of ", cache.sizes(), " ",
                      cache.scalar_type());
  TORCH_CHECK_VALUE(k_slots.numel() == T && v_slots.numel() == T && k_slots.is_contiguous() &&
                    v_slots.is_contiguous() && k_slots.scalar_type() == at::kLong &&
                    v_slots.scalar_type() == at::kLong, "store: slots");
  char* base = static_cast<char*>(cache.data_ptr());
  const int64_t* ks = k_slots.data_ptr<int64_t>();
  const int64_t* vs = v_slots.data_ptr<int64_t>();
  for (int pass = 0; pass < 2; ++pass) {
    const at::Tensor& src = pass ? value : key;
    const int64_t* slot = pass ? vs : ks;
    const char* from = static_cast<const char*>(src.data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = slot[t];
      TORCH_CHECK_VALUE(r >= 0 && r < rows, "store: slot ", r, " not in [0, ", rows, ")");
      char* row = base + ((r / (2 * tpb)) * cache.stride(0) + (r / tpb % 2) * cache.stride(1) +
                          (r % tpb) * cache.stride(2)) * es;
      for (int64_t h = 0; h < kvh; ++h)
        std::memcpy(row + h * cache.stride(3) * es,
                    from + (h * src.stride(1) + t * src.stride(2)) * es, hd * es);
    }
  }
}

// store, then varlen over every row of the step: query [1, H, T, hd] -> [1, T, H, hd]
at::Tensor store_attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& cache, const at::Tensor& k_slots,
                        const at::Tensor& v_slots, const at::Tensor& block_tables,
                        const at::Tensor& query_start, const at::Tensor& ctx_lens, double scale,
                        int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  store(cache, key, value, k_slots, v_slots);
  TORCH_CHECK_VALUE(query.dim() == 4 && query.size(0) == 1, "store_attend: query ",
                    query.sizes());
  const at::Tensor q = query.select(0, 0).transpose(0, 1).contiguous();  // [T, H, hd]
  at::Tensor out = at::empty_like(q);
  varlen(out, q, cache, block_tables, query_start, ctx_lens, scale, window, softcap, sinks);
  return out.unsqueeze(0);
}
}  // namespace

TORCH_LIBRARY(pdserve_paged, m) {
  m.def("store_attend(Tensor query, Tensor key, Tensor value, Tensor(a!) cache, "
        "Tensor k_slots, Tensor v_slots, Tensor block_tables, Tensor query_start, "
        "Tensor ctx_lens, float scale, int window, float softcap, Tensor? sinks) -> Tensor",
        &store_attend);
  m.def("varlen(Tensor(a!) out, Tensor query, Tensor cache, Tensor block_tables, "
        "Tensor query_start, Tensor ctx_lens, float scale, int window, float softcap, "
        "Tensor? sinks) -> ()", &varlen);
}
"""
