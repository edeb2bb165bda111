// cast-llm's CPU 2:4 GEMM: y = x W^T (+ b) read straight from the compressed weight, never decompressed.
//
// Compressed form of an exactly-2:4 weight W (N = out, K = in, K % 4 == 0), made by
// cast_llm.deploy.sparse24.cpu.compress:
//   values (N, K/2)    the two kept entries of every group of four inputs, in order (bf16, fp32 or int8)
//   meta   (N, K/8)    uint8, 4 bits per group: group g's nibble is bits 4(g%2)..4(g%2)+3 of byte g/2; its low
//                      2 bits are the position (0..3) of the group's first kept entry, its high 2 bits the
//                      second's. So kept value j of a row has its position at bits 2j..2j+1 of the row's
//                      little-endian bit string: 16 groups (64 inputs, 32 kept values) are one uint64.
//   scale (N,) fp32    int8 values only: W[n, k] = values[n, j] * scale[n]
//
// The kernels gather, for each block of groups, the activations at the kept positions with one permute and
// multiply-accumulate them against the kept values in fp32:
//   avx512-bf16  bf16 x and values: 64 inputs a step; the 32 positions become 16-bit permute indices with
//                vpmultishiftqb (AVX512-VBMI) + and + add, vpermt2w gathers x, vdpbf16ps multiplies pairs
//                and accumulates in fp32 (bf16 x bf16 products are exact in fp32);
//                int8 values (2:4 + W8) widened to bf16 exactly in registers, the row scale applied once at the end;
//   avx512-bf16-rows  bf16 x, bf16 or int8 values, many tokens (prefill): lanes over 16 output rows, the rows packed once
//                per call by 16 x 16 transposes; per group a broadcast of each token's four activations, then a
//                vpermw (the kept activations of 16 rows) and a vdpbf16ps per 16 rows and token (half a dense
//                GEMM's multiply-adds);
//   avx512       fp32 x (bf16 x converted once per call), fp32 / bf16 / int8 values: 32 inputs a step,
//                vpsrlvd + and + add for the indices, vpermt2ps, vfmadd; each row's values prefetched 8 KB
//                ahead at one row a block, 2 KB at four (without: 4-7 GB/s at one token, cpu24-notes.md §17);
//   amx-bf16     bf16 x and values, CPUs with AMX: 16 rows at a time expanded (vpexpandw) into a dense bf16
//                panel in L1, slice by slice, and multiplied on AMX tiles (tdpbf16ps); each weight byte read
//                once per call whatever the token count — for several tokens (at one, the avx512-bf16 gather
//                reads the bytes faster);
//   avx2         fp32 x, 32 inputs a step: 16 kept values widened by vpunpck{l,h}wd, the positions one broadcast
//                and two vpsrlvd, each token's activations laid out once per call so that per half two in-lane
//                vpermilps + a blend gather them (no lane-crossing permute), tiles of at most 2 rows x 2 tokens
//                (AVX2 has 16 registers), two accumulators at one row and token; for CPUs without AVX-512;
//   avx2-hwpf    the same loop without software prefetch (the hardware prefetchers alone): on a Zen 3 core it
//                was faster in 9 of 12 cells of an unpaired A/B and slower in 3 (cpu24-notes.md §30), so the
//                dispatcher times both per shape, as it does avx512-bf16 and avx512-bf16-hwpf;
//   avx2-tokens  fp32 x, several tokens (prefill) on CPUs without AVX-512: lanes over 16 tokens, or 8 for calls of
//                at most 8 (x transposed once per call), per kept value one broadcast and one FMA per 8 tokens on
//                the activations at its position, K in chunks whose activations fit L1: no permute.
// A single token is processed one row at a time (two memory streams per thread: values and positions, prefetched
// 8 KB ahead), and so are 2-4 tokens on avx512-bf16 where their activations fit L1; more tokens four rows and
// up to four tokens a block (the indices are computed once per row and step and reused for every token, each
// activation load serves four rows);
// threads split the output rows (at::parallel_for: torch's own thread pool and thread count). Every
// accumulation is rounded once to the output dtype, like the GPU kernels.
//
// Built by torch.utils.cpp_extension at first use (cast_llm/deploy/sparse24/cpu.py) with no -march flag: the
// ISA-specific functions carry target attributes and are chosen at run time (__builtin_cpu_supports), so one
// build runs on any x86-64 CPU and reports which paths this CPU has.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifndef CAST_PF  // software prefetch distance of the AVX2 and AMX loops, in their steps
#define CAST_PF 32
#endif
#ifndef CAST_PF_F32  // of the avx512 (fp32 activations) loop at one row a block, in bytes of values: without it
#define CAST_PF_F32 8192  // that loop read 4-7 GB/s at one token (cpu24-notes.md §17)
#endif
#ifndef CAST_PF_F32_MULTI  // the same at four rows a block (each row's values that many bytes ahead)
#define CAST_PF_F32_MULTI 2048
#endif
#ifndef CAST_PF_GATHER  // of the avx512-bf16 gather loop at one row a block (one token, or 2-4 that fit L1),
#define CAST_PF_GATHER 128  // in 64-input steps: 8 KB of bf16 values ahead; its four-row blocks keep CAST_PF (four
#endif                      // streams that far ahead evict the activations from L1: cpu24-notes.md §14, §16)

namespace {

enum ValueKind { kBF16 = 0, kF32 = 1, kI8 = 2 };

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The positions of kept values [j0, j0 + count) of a row as an integer with 2 bits each (count <= 32).
inline uint64_t read_meta(const uint8_t* meta_row, int64_t j0, int64_t count) {
  // j0 is a multiple of 4 here (a whole number of groups pairs), so it starts on a byte boundary
  uint64_t bits = 0;
  std::memcpy(&bits, meta_row + j0 / 4, static_cast<size_t>((count + 3) / 4));
  if (count < 32) bits &= (uint64_t{1} << (2 * count)) - 1;
  return bits;
}

// One output of row n: its fp32 sum times the row's scale (int8 values) plus its bias, rounded once to the output
// dtype, stored at y[at] (bf16 or fp32 y).
inline void store_out(float v, int64_t n, int64_t at, const float* scale, const float* bias, bool out_bf16,
                      void* y) {
  if (scale) v *= scale[n];
  if (bias) v += bias[n];
  if (out_bf16) static_cast<uint16_t*>(y)[at] = f32_to_bf16(v);
  else static_cast<float*>(y)[at] = v;
}

// ----------------------------------------------------------------------------------------- scalar (tails)
// One output, kept values [j0, j_end) of row n, fp32 activations (the reference the vector code follows).
template <int Kind>
inline float dot_tail(const void* values_row, const uint8_t* meta_row, const float* x, int64_t j0, int64_t j_end) {
  float acc = 0.f;
  for (int64_t j = j0; j < j_end; ++j) {
    int p = (meta_row[j / 4] >> (2 * (j % 4))) & 3;
    float v;
    if (Kind == kBF16) v = bf16_to_f32(static_cast<const uint16_t*>(values_row)[j]);
    else if (Kind == kF32) v = static_cast<const float*>(values_row)[j];
    else v = static_cast<float>(static_cast<const int8_t*>(values_row)[j]);
    acc += v * x[4 * (j / 2) + p];
  }
  return acc;
}

// ------------------------------------------------------------------------------------ AVX-512, bf16 x bf16
#define CAST_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512bf16")))

// 16-bit lane j of the index vector = position bits 2j..2j+1 of the 64-bit metadata word + 4 (j / 2): the
// multishift puts bits 2j.. in the lane's low byte, and (sel & 3) | base is one vpternlog (base has its low two
// bits clear, so | is +); vpermt2w reads only the low 6 bits of each lane.
CAST_AVX512_BF16 inline __m512i bf16_indices(uint64_t bits, __m512i ctrl, __m512i base, __m512i three) {
  __m512i sel = _mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(static_cast<long long>(bits)));
  return _mm512_ternarylogic_epi64(sel, three, base, 0xEA);  // (A & B) | C
}
CAST_AVX512_BF16 inline __m512i bf16_indices_at(const uint8_t* p, __m512i ctrl, __m512i base, __m512i three) {
  long long bits;
  std::memcpy(&bits, p, 8);  // folded into the multishift's {1to8} broadcast operand
  return bf16_indices(static_cast<uint64_t>(bits), ctrl, base, three);
}

// 32 kept values j.. of a row as bf16 pairs: bf16 as they are; int8 widened exactly (|v| <= 127 is exact in bf16)
template <int Kind>
CAST_AVX512_BF16 inline __m512i load32_bf16(const void* row, int64_t j, __mmask32 m) {
  if (Kind == kBF16) return _mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + j);
  const __m256i b = _mm256_maskz_loadu_epi8(m, static_cast<const int8_t*>(row) + j);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // values 0..15 from lo, 16..31 from hi
}

// Where the next row's values are prefetched from when a call covers only steps [s0, s1) of each row (the
// K-blocked path below, one row at a time): the prefetch stream runs past the end of this row's range into the
// next row's, kPf steps ahead in the order the rows are visited, not into this row's next chunk
struct PfAhead {
  int64_t row, step;  // where step s0 of the current row prefetches
};

// Steps [s0, s1) of 64 inputs (32 kept values) of rows n0 .. n0 + R into acc (and the masked tail when ``tail``):
// the loop of block_avx512_bf16, shared with the K-blocked path, whose rows cover one chunk of K each (``ahead``:
// the prefetch of that path, see PfAhead; nullptr: the rows' own next steps)
template <int R, int T, int Kind, bool SwPf = true>
CAST_AVX512_BF16 inline void bf16_steps(__m512 (&acc)[R][T], const void* values, const uint8_t* meta,
                                        const uint16_t* x, int64_t n0, int64_t t0, int64_t K, int64_t s0,
                                        int64_t s1, bool tail, const PfAhead* ahead) {
  const int64_t half = K / 2;
  const int64_t vsize = Kind == kBF16 ? 2 : 1;
  const char* vbase = static_cast<const char*>(values);
  const int64_t mbytes = (K + 7) / 8;
  alignas(64) uint8_t ctrl_b[64];
  alignas(64) uint16_t base_w[32];
  for (int b = 0; b < 64; ++b) ctrl_b[b] = (b % 2 == 0) ? static_cast<uint8_t>(b) : 0;  // byte 2j <- bit 2j
  for (int j = 0; j < 32; ++j) base_w[j] = static_cast<uint16_t>(4 * (j / 2));
  const __m512i ctrl = _mm512_load_si512(ctrl_b), base = _mm512_load_si512(base_w);
  const __m512i three = _mm512_set1_epi16(3);
  // prefetch distance in steps; none at all on avx512-bf16-hwpf (SwPf false: the hardware prefetchers alone,
  // faster on some cores than the distance tuned on another: cpu24-notes.md §23)
  constexpr int64_t kPf = !SwPf ? 0 : R == 1 ? CAST_PF_GATHER : CAST_PF;
  int64_t pf_row = ahead ? ahead->row : 0, pf_step = ahead ? ahead->step : 0;
  for (int64_t s = s0; s < s1; ++s) {
    __m512i xlo[T], xhi[T];
    for (int t = 0; t < T; ++t) {
      const uint16_t* xt = x + (t0 + t) * K + s * 64;
      xlo[t] = _mm512_loadu_si512(xt);
      xhi[t] = _mm512_loadu_si512(xt + 32);
    }
    if (ahead) {  // the step kPf ahead in visiting order (R rows at a time), in these rows' range or later rows'
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(vbase + ((pf_row + r) * half + pf_step * 32) * vsize, _MM_HINT_T0);
        if ((pf_step & 7) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(meta + (pf_row + r) * mbytes + pf_step * 8), _MM_HINT_T0);
      }
      if (++pf_step == s1) pf_step = s0, pf_row += R;
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      if (kPf > 0 && !ahead) {
        _mm_prefetch(vbase + (n * half + (s + kPf) * 32) * vsize, _MM_HINT_T0);
        if ((s & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(meta + n * mbytes + (s + kPf) * 8), _MM_HINT_T0);
      }
      const __m512i idx = bf16_indices_at(meta + n * mbytes + s * 8, ctrl, base, three);
      const __m512i v = Kind == kBF16 ? _mm512_loadu_si512(vbase + (n * half + s * 32) * 2)  // a whole step
                                      : load32_bf16<Kind>(vbase + n * half * vsize, s * 32, 0xffffffffu);
      for (int t = 0; t < T; ++t) {
        const __m512i g = _mm512_permutex2var_epi16(xlo[t], idx, xhi[t]);
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)v, (__m512bh)g);
      }
    }
  }
  const int64_t full = K / 64;
  const int64_t rest = K - full * 64;  // 4 .. 60 inputs left: masked loads, zeros elsewhere
  if (tail && rest) {
    const int64_t kept = rest / 2;
    const __mmask32 xm_lo = rest >= 32 ? 0xffffffffu : ((1u << rest) - 1);
    const __mmask32 xm_hi = rest > 32 ? ((1u << (rest - 32)) - 1) : 0;
    const __mmask32 vm = (1u << kept) - 1;  // kept <= 30
    __m512i xlo[T], xhi[T];
    for (int t = 0; t < T; ++t) {
      const uint16_t* xt = x + (t0 + t) * K + full * 64;
      xlo[t] = _mm512_maskz_loadu_epi16(xm_lo, xt);
      xhi[t] = _mm512_maskz_loadu_epi16(xm_hi, xt + 32);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      const uint64_t bits = read_meta(meta + n * mbytes, full * 32, kept);
      const __m512i idx = bf16_indices(bits, ctrl, base, three);
      const __m512i v = load32_bf16<Kind>(vbase + n * half * vsize, full * 32, vm);
      for (int t = 0; t < T; ++t) {
        const __m512i g = _mm512_permutex2var_epi16(xlo[t], idx, xhi[t]);
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)v, (__m512bh)g);
      }
    }
  }
}

template <int R, int T, int Kind, bool SwPf = true>
CAST_AVX512_BF16 void block_avx512_bf16(const void* values, const uint8_t* meta, const uint16_t* x,
                                        float* out, int64_t n0, int64_t t0, int64_t K, int64_t N) {
  // out: (T, R) fp32 results for rows n0.. and tokens t0..; values bf16 (Kind kBF16) or int8 (kI8)
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  bf16_steps<R, T, Kind, SwPf>(acc, values, meta, x, n0, t0, K, 0, K / 64, true, nullptr);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
  (void)N;
}

// Rows n .. n + R's chunk [s0, s1) of steps (plus the tail with the last chunk), added into out[r * T + t] (fp32)
// (SwPf false, the avx512-bf16-hwpf path: no software prefetch at all, ``ahead`` unused)
template <int R, int T, int Kind, bool SwPf = true>
CAST_AVX512_BF16 void chunk_rows_bf16(const void* values, const uint8_t* meta, const uint16_t* x, float* out,
                                      int64_t n, int64_t K, int64_t s0, int64_t s1, bool tail, PfAhead ahead) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  bf16_steps<R, T, Kind, SwPf>(acc, values, meta, x, n, 0, K, s0, s1, tail, SwPf ? &ahead : nullptr);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r * T + t] += _mm512_reduce_add_ps(acc[r][t]);
}

// -------------------------------------------------------------------------- AVX-512, fp32 x, any values
#define CAST_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

template <int Kind>
CAST_AVX512 inline __m512 load16_avx512(const void* values_row, int64_t j, __mmask16 m) {
  if (Kind == kF32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(values_row) + j);
  if (Kind == kBF16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(values_row) + j);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  __m128i b = _mm_maskz_loadu_epi8(m, static_cast<const int8_t*>(values_row) + j);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

template <int Kind, int R, int T>
CAST_AVX512 void block_avx512(const void* values, const uint8_t* meta, const float* x, float* out, int64_t n0,
                              int64_t t0, int64_t K, int64_t N) {
  const int64_t half = K / 2;
  const int64_t mbytes = (K + 7) / 8;
  const int64_t vsize = Kind == kF32 ? 4 : (Kind == kBF16 ? 2 : 1);
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i three = _mm512_set1_epi32(3);
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t steps = (K + 31) / 32;  // 32 inputs (16 kept values) a step; the last one masked
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t rest = K - s * 32 >= 32 ? 32 : K - s * 32;
    const __mmask16 xm_lo = rest >= 16 ? 0xffff : static_cast<__mmask16>((1u << rest) - 1);
    const __mmask16 xm_hi = rest > 16 ? static_cast<__mmask16>((1u << (rest - 16)) - 1) : 0;
    const __mmask16 vm = rest == 32 ? 0xffff : static_cast<__mmask16>((1u << (rest / 2)) - 1);
    __m512 xlo[T], xhi[T];
    for (int t = 0; t < T; ++t) {
      const float* xt = x + (t0 + t) * K + s * 32;
      xlo[t] = _mm512_maskz_loadu_ps(xm_lo, xt);
      xhi[t] = _mm512_maskz_loadu_ps(xm_hi, xt + 16);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      constexpr int64_t kAhead = R == 1 ? CAST_PF_F32 : CAST_PF_F32_MULTI;  // bytes of values
      if (kAhead > 0) {  // a row's two streams, the positions an eighth as far ahead
        _mm_prefetch(static_cast<const char*>(values) + (n * half + s * 16) * vsize + kAhead, _MM_HINT_T0);
        if ((s & 15) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(meta + n * mbytes + s * 4) + kAhead / 8, _MM_HINT_T0);
      }
      uint32_t bits;
      if (rest == 32) std::memcpy(&bits, meta + n * mbytes + s * 4, 4);  // a whole step: one 4-byte load
      else bits = static_cast<uint32_t>(read_meta(meta + n * mbytes, s * 16, rest / 2));
      const __m512i idx = _mm512_add_epi32(
          _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits)), shifts), three), base);
      const __m512 v = load16_avx512<Kind>(static_cast<const char*>(values) + n * half * vsize, s * 16, vm);
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_fmadd_ps(v, _mm512_permutex2var_ps(xlo[t], idx, xhi[t]), acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
  (void)N;
}

// ------------------------------------------------------------------------------- AVX2, fp32 x, any values
#define CAST_AVX2 __attribute__((target("avx2,fma")))

CAST_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The 16 kept values of a 32-input step as two fp32 vectors in the order the in-lane permutes produce them:
// a = kept values [0-3 | 8-11], b = [4-7 | 12-15] (128-bit lanes). bf16: one 256-bit load, vpunpck{l,h}wd with
// zero (the bf16 bits become the high half of each fp32: widened exactly, one µop for 8 values); fp32: two loads
// and two vperm2f128; int8: one vpshufb of the 16 bytes, then two vpmovsxbd + vcvtdq2ps.
template <int Kind>
CAST_AVX2 inline __attribute__((always_inline)) void load16_lanes_avx2(const void* values_row, int64_t j, __m256& a,
                                                                       __m256& b) {
  if (Kind == kBF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(values_row) + j));
    const __m256i z = _mm256_setzero_si256();
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
  } else if (Kind == kF32) {
    const float* p = static_cast<const float*>(values_row) + j;
    const __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
    a = _mm256_permute2f128_ps(lo, hi, 0x20);
    b = _mm256_permute2f128_ps(lo, hi, 0x31);
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(values_row) + j));
    const __m128i r = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15));
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(r));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(r, r)));
  }
}

// The activations of one token as the AVX2 steps read them (sparse24_mm lays them out once per call): in every
// whole 32-input step the 128-bit quarters [0-3, 16-19, 4-7, 20-23, 8-11, 24-27, 12-15, 28-31], so that the step's
// four 256-bit loads are [0-3 | 16-19], [4-7 | 20-23], [8-11 | 24-27], [12-15 | 28-31]: each lane of a and b then
// finds its group's four inputs in the same 128-bit lane of one of two of them. The tail past the last whole step
// stays in order (dot_tail reads it). kLayoutFrom[q]: where quarter q of a laid-out step comes from.
constexpr int kLayoutFrom[8] = {0, 16, 4, 20, 8, 24, 12, 28};
CAST_AVX2 void avx2_layout_x(const float* x, float* out, int64_t K) {
  const int64_t full = K / 32;
  for (int64_t s = 0; s < full; ++s)
    for (int q = 0; q < 8; ++q) _mm_storeu_ps(out + s * 32 + q * 4, _mm_loadu_ps(x + s * 32 + kLayoutFrom[q]));
  std::memcpy(out + full * 32, x + full * 32, static_cast<size_t>(K - full * 32) * sizeof(float));
}

// avx2_layout_x for bf16 activations: each four inputs widened to fp32 (exact: the bits shifted up by 16) as they
// are laid out, one pass instead of a widening copy of x and then the layout
CAST_AVX2 void avx2_layout_x_bf16(const uint16_t* x, float* out, int64_t K) {
  const int64_t full = K / 32;
  for (int64_t s = 0; s < full; ++s)
    for (int q = 0; q < 8; ++q) {
      const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + s * 32 + kLayoutFrom[q]));
      _mm_storeu_ps(out + s * 32 + q * 4, _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)));
    }
  for (int64_t k = full * 32; k < K; ++k) {
    const uint32_t bits = static_cast<uint32_t>(x[k]) << 16;
    std::memcpy(out + k, &bits, sizeof(float));
  }
}

template <int Kind, int R, int T, bool SwPf>
CAST_AVX2 inline __attribute__((always_inline)) void tile_step_avx2(const void* values, const uint8_t* meta,
                                                                    const float* x, __m256 (&acc)[R][T], int64_t s,
                                                                    int64_t n0, int64_t t0, int64_t K) {
  const int64_t half = K / 2;
  const int64_t mbytes = (K + 7) / 8;
  const int64_t vsize = Kind == kF32 ? 4 : (Kind == kBF16 ? 2 : 1);
  // lane e of a holds kept value e (e < 4) or e + 4: its position is bits 2e.. or 2e + 8.. of the step's word
  const __m256i shifts_a = _mm256_setr_epi32(0, 2, 4, 6, 16, 18, 20, 22);
  const __m256i shifts_b = _mm256_setr_epi32(8, 10, 12, 14, 24, 26, 28, 30);
  __m256i ia[R], ib[R];
  __m256 va[R], vb[R];
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
    if (SwPf && CAST_PF > 0) {
      // a 64-byte line of values every 64 / (16 vsize) steps, of positions every 16 steps, the same bytes ahead
      // as the 16-input loop's CAST_PF steps (none on the avx2-hwpf path)
      if ((s & (64 / (16 * vsize) - 1)) == 0)
        _mm_prefetch(static_cast<const char*>(values) + (n * half + (s + CAST_PF / 2) * 16) * vsize, _MM_HINT_T0);
      if ((s & 15) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(meta + n * mbytes + (s + CAST_PF / 2) * 4), _MM_HINT_T0);
    }
    int32_t bits;
    std::memcpy(&bits, meta + n * mbytes + s * 4, 4);
    const __m256i b = _mm256_set1_epi32(bits);
    ia[r] = _mm256_srlv_epi32(b, shifts_a);  // vpermilps reads the low 2 bits of each lane
    ib[r] = _mm256_srlv_epi32(b, shifts_b);
    load16_lanes_avx2<Kind>(static_cast<const char*>(values) + n * half * vsize, s * 16, va[r], vb[r]);
  }
  for (int t = 0; t < T; ++t) {
    const float* xt = x + (t0 + t) * K + s * 32;
    const __m256 x0 = _mm256_loadu_ps(xt), x1 = _mm256_loadu_ps(xt + 8);
    const __m256 x2 = _mm256_loadu_ps(xt + 16), x3 = _mm256_loadu_ps(xt + 24);
    for (int r = 0; r < R; ++r) {
      // lanes 0, 1 | 4, 5 of a: groups 0 | 4 (x0); lanes 2, 3 | 6, 7: groups 1 | 5 (x1); b likewise from x2, x3
      const __m256 ga = _mm256_blend_ps(_mm256_permutevar_ps(x0, ia[r]), _mm256_permutevar_ps(x1, ia[r]), 0xCC);
      const __m256 gb = _mm256_blend_ps(_mm256_permutevar_ps(x2, ib[r]), _mm256_permutevar_ps(x3, ib[r]), 0xCC);
      acc[r][t] = _mm256_fmadd_ps(va[r], ga, _mm256_fmadd_ps(vb[r], gb, acc[r][t]));
    }
  }
}

// One tile of at most two rows and two tokens; a single row and token keeps two accumulators (two steps in
// flight: the FMA's latency hidden). x: the activations laid out by avx2_layout_x.
template <int Kind, int R, int T, bool SwPf>
CAST_AVX2 void tile_avx2(const void* values, const uint8_t* meta, const float* x, float* out, int64_t n0,
                         int64_t t0, int64_t K, int R_all, int r_off, int t_off) {
  constexpr int U = (R == 1 && T == 1) ? 2 : 1;
  const int64_t half = K / 2;
  const int64_t mbytes = (K + 7) / 8;
  const int64_t vsize = Kind == kF32 ? 4 : (Kind == kBF16 ? 2 : 1);
  __m256 acc[U][R][T];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[u][r][t] = _mm256_setzero_ps();
  const int64_t full = K / 32;
  int64_t s = 0;
  for (; s + U <= full; s += U)
    for (int u = 0; u < U; ++u)
      tile_step_avx2<Kind, R, T, SwPf>(values, meta, x, acc[u], s + u, n0 + r_off, t0 + t_off, K);
  for (; s < full; ++s) tile_step_avx2<Kind, R, T, SwPf>(values, meta, x, acc[0], s, n0 + r_off, t0 + t_off, K);
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r_off + r;
    const void* vrow = static_cast<const char*>(values) + n * half * vsize;
    for (int t = 0; t < T; ++t) {
      __m256 a = acc[0][r][t];
      if (U == 2) a = _mm256_add_ps(a, acc[U - 1][r][t]);
      const float tail = dot_tail<Kind>(vrow, meta + n * mbytes, x + (t0 + t_off + t) * K, full * 16, half);
      out[(t_off + t) * R_all + r_off + r] = hsum256(a) + tail;
    }
  }
}

// A block of R rows and T tokens (the driver's) as tiles of at most 2 x 2: ``tile(Rt, Tt, r, t)`` runs the tile
// of Rt rows from r and Tt tokens from t (Rt, Tt as std::integral_constant, so the tile is a template instance).
template <class Tile>
inline void in_tiles_2x2(int R, int T, const Tile& tile) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  for (int r = 0; r < R; r += 2)
    for (int t = 0; t < T; t += 2) {
      const bool r2 = r + 1 < R, t2 = t + 1 < T;
      if (r2 && t2) tile(Two{}, Two{}, r, t);
      else if (r2) tile(Two{}, One{}, r, t);
      else if (t2) tile(One{}, Two{}, r, t);
      else tile(One{}, One{}, r, t);
    }
}

template <int Kind, int R, int T, bool SwPf>
CAST_AVX2 void block_avx2(const void* values, const uint8_t* meta, const float* x, float* out, int64_t n0,
                          int64_t t0, int64_t K, int64_t N) {
  in_tiles_2x2(R, T, [&](auto rt, auto tt, int r, int t) {
    tile_avx2<Kind, decltype(rt)::value, decltype(tt)::value, SwPf>(values, meta, x, out, n0, t0, K, R, r, t);
  });
  (void)N;
}


// ------------------------------------------------------------------- AVX2, many tokens: lanes over tokens
// The 2:4 product as a sparse GEMM should be: one multiply-add per kept value and token, half a dense GEMM's. The
// activations of 16 tokens are transposed once per call (xt: per block of 16 tokens, [input][16] fp32, the last
// block zero-padded); per row and kept value one broadcast of the value and two FMAs whose second operand is the
// 16 tokens' activations at the kept position (two 8-lane loads from L1), so no permute at all. K is visited in
// chunks of CAST_TOK_KC inputs whose 16 tokens' activations fit L1 (256 inputs: 16 KB); a thread visits its rows
// chunk by chunk, carrying each row's 16 fp32 sums between chunks. Each weight byte is read once per 16 tokens
// (8 lanes for calls of at most 8 tokens: below).
#ifndef CAST_TOK_KC
#define CAST_TOK_KC 256
#endif
// Lanes: 16 tokens a block (two vectors a kept value), or 8 where the call has at most 8 tokens (one vector: 16
// lanes would leave more than half of them empty). The chunk holds 16 KB of activations either way.
static_assert(CAST_TOK_KC % 64 == 0, "CAST_TOK_KC: a multiple of 64 inputs (whole 32-value position words a chunk)");
inline int64_t token_lanes(int64_t M) { return M <= 8 ? 8 : 16; }

// x (M, K) fp32 -> xt: for token block b of L lanes, xt[(b K + k) L + l] = x[L b + l, k] (0 past M)
void avx2_tokens_layout(const float* x, float* xt, int64_t M, int64_t K, int64_t L) {
  const int64_t blocks = (M + L - 1) / L;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t l = 0; l < L; ++l) {
      const int64_t t = b * L + l;
      float* dst = xt + b * K * L + l;
      if (t < M) {
        const float* src = x + t * K;
        for (int64_t k = 0; k < K; ++k) dst[k * L] = src[k];
      } else {
        for (int64_t k = 0; k < K; ++k) dst[k * L] = 0.f;
      }
    }
}

// kept values [j0, j0 + count) of a row as fp32 (in order), for the broadcasts
template <int Kind>
CAST_AVX2 inline void widen_values_avx2(const void* values_row, int64_t j0, int64_t count, float* out) {
  int64_t j = 0;
  if (Kind == kBF16) {
    const uint16_t* v = static_cast<const uint16_t*>(values_row) + j0;
    for (; j + 8 <= count; j += 8)
      _mm256_storeu_ps(out + j, _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j))), 16)));
    for (; j < count; ++j) out[j] = bf16_to_f32(v[j]);
  } else if (Kind == kF32) {
    std::memcpy(out, static_cast<const float*>(values_row) + j0, static_cast<size_t>(count) * sizeof(float));
  } else {
    const int8_t* v = static_cast<const int8_t*>(values_row) + j0;
    for (; j + 8 <= count; j += 8)
      _mm256_storeu_ps(out + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + j)))));
    for (; j < count; ++j) out[j] = static_cast<float>(v[j]);
  }
}

// 32 kept values (or fewer: n) of one row against the block's 8 V tokens: four accumulator sets (the FMA latency
// hidden), V vectors each
template <int N32, int V>
CAST_AVX2 inline __attribute__((always_inline)) void tokens_word_avx2(uint64_t bits, const float* v, const float* xw,
                                                                      int n, __m256 (&a)[4][V]) {
#pragma GCC unroll 32
  for (int jj = 0; jj < 32; ++jj) {
    if (N32 == 0 && jj >= n) break;
    const float* xr = xw + ((jj / 2) * 4 + static_cast<int64_t>((bits >> (2 * jj)) & 3)) * (8 * V);
    const __m256 vv = _mm256_broadcast_ss(v + jj);
    for (int u = 0; u < V; ++u) a[jj & 3][u] = _mm256_fmadd_ps(vv, _mm256_loadu_ps(xr + 8 * u), a[jj & 3][u]);
  }
}

// one thread's rows [n0, n1): every token block, chunk by chunk (a function of its own: a lambda would not carry
// the target attribute)
template <int Kind, int V>
CAST_AVX2 void tokens_rows_avx2(const float* xt, const void* values, const uint8_t* meta, const float* scale,
                                const float* bias, void* y, bool out_bf16, int64_t M, int64_t N, int64_t K,
                                int64_t n0, int64_t n1) {
  constexpr int64_t L = 8 * V;
  const int64_t half = K / 2, mbytes = (K + 7) / 8;
  const int64_t vsize = Kind == kF32 ? 4 : (Kind == kBF16 ? 2 : 1);
  const int64_t blocks = (M + L - 1) / L;
  const int64_t kc = CAST_TOK_KC * 2 / V;  // 16 KB of activations a chunk
  std::vector<float> sums(static_cast<size_t>((n1 - n0) * L));
  alignas(32) float vf[CAST_TOK_KC];
  for (int64_t b = 0; b < blocks; ++b) {
    std::fill(sums.begin(), sums.end(), 0.f);
    const float* xb = xt + b * K * L;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t j0 = k0 / 2, count = std::min(kc, K - k0) / 2;
      const float* xc = xb + k0 * L;
      for (int64_t n = n0; n < n1; ++n) {
        const char* vrow = static_cast<const char*>(values) + n * half * vsize;
        const uint8_t* mrow = meta + n * mbytes;
        if (n + 2 < n1) {  // the row after next's piece of this chunk: a strided stream the prefetchers may miss
          const char* nv = vrow + 2 * half * vsize + j0 * vsize;
          for (int64_t off = 0; off < count * vsize; off += 64) _mm_prefetch(nv + off, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(mrow + 2 * mbytes + j0 / 4), _MM_HINT_T0);
        }
        widen_values_avx2<Kind>(vrow, j0, count, vf);
        __m256 a[4][V];
        for (int u = 0; u < 4; ++u)
          for (int w = 0; w < V; ++w) a[u][w] = _mm256_setzero_ps();
        int64_t w = 0;
        for (; w + 32 <= count; w += 32) {
          uint64_t bits;
          std::memcpy(&bits, mrow + (j0 + w) / 4, 8);
          tokens_word_avx2<1, V>(bits, vf + w, xc + (w / 2) * 4 * L, 32, a);
        }
        if (w < count)
          tokens_word_avx2<0, V>(read_meta(mrow, j0 + w, count - w), vf + w, xc + (w / 2) * 4 * L,
                                 static_cast<int>(count - w), a);
        float* srow = sums.data() + (n - n0) * L;
        for (int u = 0; u < V; ++u) {
          const __m256 s = _mm256_add_ps(_mm256_add_ps(a[0][u], a[1][u]), _mm256_add_ps(a[2][u], a[3][u]));
          _mm256_storeu_ps(srow + 8 * u, _mm256_add_ps(_mm256_loadu_ps(srow + 8 * u), s));
        }
      }
    }
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t l = 0; l < L && b * L + l < M; ++l)
        store_out(sums[(n - n0) * L + l], n, (b * L + l) * N + n, scale, bias, out_bf16, y);
  }
}

template <int Kind, int V>
void sparse24_mm_avx2_tokens(const float* xt, const void* values, const uint8_t* meta, const float* scale,
                             const float* bias, void* y, bool out_bf16, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (M + 8 * V - 1) / (8 * V);
  const int64_t grain = std::max<int64_t>(1, 256 * 1024 / std::max<int64_t>(K * blocks * V, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    tokens_rows_avx2<Kind, V>(xt, values, meta, scale, bias, y, out_bf16, M, N, K, n0, n1);
  });
}

// ------------------------------------------------------------------------------- AMX-BF16 (Intel AMX)
// For CPUs with AMX (amx_tile, amx_bf16; Sapphire Rapids and later): per block of 16 output rows, the rows'
// compressed bytes are read once, row by row (two memory streams), and expanded into a dense bf16 panel in L2
// (vpexpandw: a 32-bit mask per 32 inputs, made from the positions through a 256-entry table, places the 16 kept
// values of a chunk at their positions, zeros elsewhere); then tdpbf16ps multiplies the panel's 16 x 32 tiles
// against the activations, which were rearranged once per call into AMX's pair layout (16 tokens a tile, up to
// four token tiles held in the accumulators at once). The weight bytes are read once whatever the token count,
// and AMX's multiply (16 x 16 x 32 a tile instruction) makes the product cheap: one token costs the same as 16.
#define CAST_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx512bf16,amx-tile,amx-bf16")))

bool amx_cpu() {  // CPUID leaf 7: AMX-TILE (EDX 24), AMX-BF16 (EDX 22), AVX512-VBMI2 (ECX 6)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1u) && (d >> 22 & 1u) && (c >> 6 & 1u);
}

bool amx_permitted() {  // Linux hands out AMX's 8 KB tile state only on request (once per process)
  static const bool ok = [] {
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct MaskLut {  // one meta byte (two groups' positions) -> the groups' 8-bit dense mask
  uint8_t m[256];
  constexpr MaskLut() : m() {
    for (int b = 0; b < 256; ++b)
      m[b] = static_cast<uint8_t>((1u << (b & 3)) | (1u << (b >> 2 & 3)) | (1u << (4 + (b >> 4 & 3))) |
                                  (1u << (4 + (b >> 6 & 3))));
  }
};
constexpr MaskLut kMaskLut;

constexpr int64_t kAmxRows = 16;    // output rows a block (a tile's rows)
constexpr int kAmxTokenTiles = 4;   // token tiles in the accumulators at once (tiles 0..3; 4: weights, 5-6: x)

// A row's position bytes -> its dense mask bytes (bit k: input k kept), 64 bytes at a time: the 256-entry table
// as two 128-entry vpermt2b lookups picked by each byte's top bit
CAST_AMX void amx_row_mask(const uint8_t* m, int64_t mbytes, uint8_t* out) {
  const __m512i t0 = _mm512_loadu_si512(kMaskLut.m), t1 = _mm512_loadu_si512(kMaskLut.m + 64);
  const __m512i t2 = _mm512_loadu_si512(kMaskLut.m + 128), t3 = _mm512_loadu_si512(kMaskLut.m + 192);
  for (int64_t b = 0; b < mbytes; b += 64) {
    const int64_t n = std::min<int64_t>(64, mbytes - b);
    const __mmask64 live = n == 64 ? ~0ULL : ((1ULL << n) - 1);
    const __m512i idx = _mm512_maskz_loadu_epi8(live, m + b);
    const __m512i lo = _mm512_permutex2var_epi8(t0, idx, t1), hi = _mm512_permutex2var_epi8(t2, idx, t3);
    _mm512_mask_storeu_epi8(out + b, live, _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi));
  }
}

constexpr int64_t kAmxSlice = 16;  // chunks of 32 inputs a panel slice: 16 rows x 512 inputs, 16 KB (in L1)

// panel[r][0..32 (c1 - c0)): inputs 32 c0 .. 32 c1 of rows n0..n0+R-1 of W, dense (zeros past K and in rows
// R..15); each row's slice read in order (its values and position bytes are contiguous)
CAST_AMX void amx_panel(const uint16_t* values, const uint8_t* meta, int64_t n0, int64_t R, int64_t K,
                        int64_t c0, int64_t c1, uint16_t* panel) {
  const int64_t half = K / 2, mbytes = (K + 7) / 8, whole = K / 32, width = (c1 - c0) * 32;
  const __m512i t0 = _mm512_loadu_si512(kMaskLut.m), t1 = _mm512_loadu_si512(kMaskLut.m + 64);
  const __m512i t2 = _mm512_loadu_si512(kMaskLut.m + 128), t3 = _mm512_loadu_si512(kMaskLut.m + 192);
  alignas(64) uint8_t mrow[64];
  for (int64_t r = 0; r < kAmxRows; ++r) {
    uint16_t* out = panel + r * width;
    if (r >= R) {
      for (int64_t c = c0; c < c1; ++c) _mm512_storeu_si512(out + (c - c0) * 32, _mm512_setzero_si512());
      continue;
    }
    const uint16_t* v = values + (n0 + r) * half;
    // the slice's position bytes -> dense mask bytes (bit k: input k kept): the 256-entry table as two
    // 128-entry vpermt2b lookups picked by each byte's top bit
    const int64_t b0 = 4 * c0, nb = std::min<int64_t>(4 * (c1 - c0), mbytes - b0);
    const __mmask64 live = nb >= 64 ? ~0ULL : ((1ULL << nb) - 1);
    const __m512i idx = _mm512_maskz_loadu_epi8(live, meta + (n0 + r) * mbytes + b0);
    const __m512i lo = _mm512_permutex2var_epi8(t0, idx, t1), hi = _mm512_permutex2var_epi8(t2, idx, t3);
    _mm512_store_si512(mrow, _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi));
    const int64_t cw = std::min(c1, whole);
    for (int64_t c = c0; c < cw; ++c) {
#if CAST_PF > 0
      if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(v + 16 * (c + CAST_PF)), _MM_HINT_T0);
#endif
      uint32_t mask;
      std::memcpy(&mask, mrow + 4 * (c - c0), 4);
      const __m512i kept = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c)));
      _mm512_storeu_si512(out + (c - c0) * 32, _mm512_maskz_expand_epi16(mask, kept));
    }
    if (cw < c1) {  // 4..28 inputs left: only their bytes are read, the mask cut to them
      const int64_t kc = K - whole * 32;
      uint32_t mask;
      std::memcpy(&mask, mrow + 4 * (whole - c0), 4);
      mask &= (1u << kc) - 1u;
      _mm512_storeu_si512(out + (whole - c0) * 32, _mm512_maskz_expandloadu_epi16(mask, v + 16 * whole));
    }
  }
}

// Accumulator tile j (0..3) holds token tile j % nt of chunks c with c % chains == j / nt (chains = 4 / nt): a
// tdpbf16ps waits for the previous one into the same tile (~50 cycles), so one token tile alone would be a
// chain of dependent products; four tiles over alternate chunks keep four in flight. Tile 6 takes the last
// token tile (its width may be partial), tile 5 the others.
CAST_AMX void amx_zero(int used) {
#define CAST_AMX_ZERO(J) if (J < used) _tile_zero(J);
  CAST_AMX_ZERO(0) CAST_AMX_ZERO(1) CAST_AMX_ZERO(2) CAST_AMX_ZERO(3)
#undef CAST_AMX_ZERO
}

// acc += the panel slice (chunks c0..c1) x token tiles tile0..tile0+nt-1
CAST_AMX void amx_tiles(const uint16_t* panel, const uint32_t* xv, int64_t c0, int64_t c1, int64_t P,
                        int64_t tile0, int nt) {
  const int chains = 4 / nt, used = nt * chains;
  const int64_t stride = (c1 - c0) * 64;
  for (int64_t c = c0; c < c1; ++c) {
    _tile_loadd(4, panel + (c - c0) * 32, stride);
    const int chain = static_cast<int>(c % chains);
#define CAST_AMX_STEP(J)                                                            \
  if (J < used && J / nt == chain) {                                               \
    const int i = J % nt;                                                           \
    const uint32_t* b = xv + ((tile0 + i) * P + 16 * c) * 16;                       \
    if (i == nt - 1) { _tile_loadd(6, b, 64); _tile_dpbf16ps(J, 4, 6); }           \
    else { _tile_loadd(5, b, 64); _tile_dpbf16ps(J, 4, 5); }                       \
  }
    CAST_AMX_STEP(0) CAST_AMX_STEP(1) CAST_AMX_STEP(2) CAST_AMX_STEP(3)
#undef CAST_AMX_STEP
  }
}

// cbuf[j][row][token] <- tile j (16 x 16 floats a tile), the chains folded into tiles 0..nt-1
CAST_AMX void amx_store(int nt, float* cbuf) {
  const int used = nt * (4 / nt);
#define CAST_AMX_STORE(J) if (J < used) _tile_stored(J, cbuf + J * 256, 64);
  CAST_AMX_STORE(0) CAST_AMX_STORE(1) CAST_AMX_STORE(2) CAST_AMX_STORE(3)
#undef CAST_AMX_STORE
  for (int j = nt; j < used; ++j)
    for (int e = 0; e < 256; ++e) cbuf[(j % nt) * 256 + e] += cbuf[j * 256 + e];
}

CAST_AMX void amx_load_config(const TileConfig* cfg) { _tile_loadconfig(cfg); }
CAST_AMX void amx_release() { _tile_release(); }

// y (M, N) bf16 = x (M, K) bf16 . W^T (+ bias fp32), W as bf16 values + meta
void sparse24_mm_amx(const uint16_t* x, const uint16_t* values, const uint8_t* meta, const float* bias,
                     uint16_t* y, int64_t M, int64_t N, int64_t K) {
  const int64_t C = (K + 31) / 32, P = C * 16, tiles = (M + 15) / 16;
  // x in AMX's pair layout: xv[tile][p][token] = the bf16 pair (x[t][2p], x[t][2p + 1]) of token 16 tile + token
  // scratch kept per thread between calls (a fresh 128 KB+ vector is a fresh mmap: page faults every call)
  thread_local std::vector<uint32_t> xv_scratch;
  xv_scratch.resize(std::max(xv_scratch.size(), static_cast<size_t>(tiles * P * 16)));
  uint32_t* const xv = xv_scratch.data();  // (the workers below see this thread's buffer through the pointer)
  std::fill(xv, xv + tiles * P * 16, 0u);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t t = m0; t < m1; ++t) {
      const uint32_t* xt = reinterpret_cast<const uint32_t*>(x + t * K);
      uint32_t* dst = xv + (t / 16) * P * 16 + t % 16;
      for (int64_t p = 0; p < K / 2; ++p) dst[p * 16] = xt[p];
    }
  });
  const int groups = static_cast<int>((tiles + kAmxTokenTiles - 1) / kAmxTokenTiles);
  std::vector<TileConfig> cfgs(groups);
  for (int g = 0; g < groups; ++g) {
    const int nt = static_cast<int>(std::min<int64_t>(kAmxTokenTiles, tiles - g * kAmxTokenTiles));
    const int64_t last = std::min<int64_t>(16, M - 16 * (g * kAmxTokenTiles + nt - 1));  // tokens of the last tile
    TileConfig& cfg = cfgs[g];
    for (int j = 0; j < nt * (4 / nt); ++j) {
      cfg.rows[j] = 16;
      cfg.colsb[j] = static_cast<uint16_t>(j % nt == nt - 1 ? 4 * last : 64);
    }
    cfg.rows[4] = 16; cfg.colsb[4] = 64;
    cfg.rows[5] = 16; cfg.colsb[5] = 64;
    cfg.rows[6] = 16; cfg.colsb[6] = static_cast<uint16_t>(4 * last);
  }
  const int64_t blocks = (N + kAmxRows - 1) / kAmxRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    // the block's panel, slice after slice (16 KB each): expanded during the first token group, reused by the
    // others (more than 64 tokens), so each weight byte is read from memory once per call
    const int64_t slices = (C + kAmxSlice - 1) / kAmxSlice;
    thread_local std::vector<uint16_t> panels;
    panels.resize(std::max(panels.size(), static_cast<size_t>(slices * kAmxRows * kAmxSlice * 32)));
    alignas(64) float cbuf[kAmxTokenTiles * 256];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kAmxRows, R = std::min(kAmxRows, N - n0);
      for (int g = 0; g < groups; ++g) {
        const int64_t tile0 = int64_t(g) * kAmxTokenTiles;
        const int nt = static_cast<int>(std::min<int64_t>(kAmxTokenTiles, tiles - tile0));
        if (b == b0 || groups > 1) amx_load_config(&cfgs[g]);
        amx_zero(nt * (4 / nt));
        for (int64_t c0 = 0; c0 < C; c0 += kAmxSlice) {
          const int64_t c1 = std::min(C, c0 + kAmxSlice);
          uint16_t* panel = panels.data() + (c0 / kAmxSlice) * kAmxRows * kAmxSlice * 32;
          if (g == 0) amx_panel(values, meta, n0, R, K, c0, c1, panel);
          amx_tiles(panel, xv, c0, c1, P, tile0, nt);
        }
        amx_store(nt, cbuf);
        for (int i = 0; i < nt; ++i)
          for (int64_t tt = 0; tt < 16; ++tt) {
            const int64_t t = 16 * (tile0 + i) + tt;
            if (t >= M) break;
            for (int64_t r = 0; r < R; ++r) {
              float v = cbuf[i * 256 + r * 16 + tt];
              if (bias) v += bias[n0 + r];
              y[t * N + n0 + r] = f32_to_bf16(v);
            }
          }
      }
    }
    amx_release();
  });
}

// ---------------------------------------------------------------- avx512-bf16-rows: lanes over output rows
// For many tokens (prefill), lanes over 16 output rows as a dense GEMM's are. Per thread, a set of up to 48 rows
// (kRowBlocks lane blocks) is packed once per call: for every group, the 16 rows' two kept values (one vector of
// bf16 pairs, by 16 x 16 transposes) and their positions as vpermw indices (lane word 0 = the group's nibble p0 | p1 << 2,
// word 1 = p1; vpermw reads 5 bits, and the broadcast below repeats the group's four activations every four
// words, so word p0 + 4 p1 holds x[p0]). Then kRowTokens tokens at a time, every group is one 8-byte broadcast of
// each token's four activations and, per lane block and token, one vpermw (the kept activations of 16 rows) and one
// vdpbf16ps: half a dense GEMM's multiply-adds, every load from a sequential stream (no address taken from the
// positions), the outputs contiguous in y. Any positions are read correctly (repeated or descending ones too).
constexpr int kRowBlocks = 3;
constexpr int kRowTokens = 6;
#ifndef CAST_ROW_AHEAD
#define CAST_ROW_AHEAD 4
#endif
constexpr int kRowAhead = CAST_ROW_AHEAD;  // chunks of 16 groups a row's prefetch runs ahead

// r[l] = 16 dwords of row l -> r[c] = dword c of rows 0..15 (unpacks within 128-bit lanes, then lane shuffles)
CAST_AVX512_BF16 inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + j], lane k: column 4k + j of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);       // column j      (lane k = 0)
    r[4 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);   // column 4 + j  (k = 1)
    r[8 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);   // column 8 + j  (k = 2)
    r[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);  // column 12 + j (k = 3)
  }
}

// Rows [r0, r0 + 16 RB) (rows >= N read as zero) into Wp / Ip[g * RB + b]: 16 rows x 16 groups of kept pairs (one
// 64-byte load a row, masked at the row's end) and 16 rows x 128 groups of positions a transpose
// (int8 kept values, 2:4 + W8: widened to bf16 exactly as they are loaded, the row scales applied at the store)
template <int Kind>
CAST_AVX512_BF16 void rows_pack(const void* values, const uint8_t* meta, int64_t N, int64_t K, int64_t r0,
                                int RB, __m512i* Wp, __m512i* Ip) {
  const int64_t G = K / 4, mbytes = (K + 7) / 8;
  constexpr int64_t vb = Kind == kBF16 ? 2 : 1;  // bytes a kept value
  const __m512i nib_mask = _mm512_set1_epi32(15);
  for (int b = 0; b < RB; ++b) {
    const int64_t rb = r0 + 16 * b, n = std::min<int64_t>(16, N - rb);
    const char* vbase = static_cast<const char*>(values) + rb * (K / 2) * vb;
    const uint8_t* mbase = meta + rb * mbytes;
    __m512i r[16];
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
      const int64_t ng = std::min<int64_t>(16, G - g0);
      const __mmask32 m = ng == 16 ? 0xffffffffu : static_cast<__mmask32>((1ull << (2 * ng)) - 1);
      for (int l = 0; l < 16; ++l) {
        // 16 row streams K bytes apart: ask for each row's line kRowAhead chunks ahead (past the end of the
        // arrays the address is only an integer: a prefetch may point anywhere)
        const char* row = vbase + l * (K / 2) * vb;
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row + 2 * g0 * vb) +
                                                   64 * kRowAhead), _MM_HINT_T0);
        r[l] = l < n ? load32_bf16<Kind>(row, 2 * g0, m) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (int64_t c = 0; c < ng; ++c) Wp[(g0 + c) * RB + b] = r[c];
    }
    for (int64_t g0 = 0; g0 < G; g0 += 128) {  // 64 bytes of a row's positions: 128 groups
      const int64_t nb = std::min<int64_t>(64, mbytes - g0 / 2);
      const __mmask64 m = nb == 64 ? ~__mmask64{0} : ((__mmask64{1} << nb) - 1);
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(mbase + l * mbytes + g0 / 2) + 64),
                     _MM_HINT_T0);
        r[l] = l < n ? _mm512_maskz_loadu_epi8(m, mbase + l * mbytes + g0 / 2) : _mm512_setzero_si512();
      }
      transpose16x16(r);  // r[c]: groups g0 + 8c .. g0 + 8c + 7 of rows 0..15, 4 bits each
      for (int64_t g = g0; g < std::min<int64_t>(G, g0 + 128); ++g) {
        const __m512i nib = _mm512_and_si512(_mm512_srli_epi32(r[(g - g0) / 8], 4 * ((g - g0) % 8)), nib_mask);
        Ip[g * RB + b] = _mm512_or_si512(nib, _mm512_slli_epi32(nib, 14));
      }
    }
  }
}

// Where ``next`` is given (the first tile of a set), three 64-byte lines of the next set's kept values are
// prefetched into L2 per group, so that its pack reads them from L2 instead of waiting on DRAM (the pack is
// not otherwise overlapped with compute: at 16 tokens it was a third of the call)
struct RowsAhead {
  const char* base = nullptr;  // the next set's first row of kept values
  int64_t row_bytes = 0, rows = 0;
};

// A cache size of this core from sysconf (``name``: _SC_LEVEL1_DCACHE_SIZE, ...), ``fallback`` where the C
// library does not say
inline int64_t cache_bytes(int name, int64_t fallback) {
  const long v = sysconf(name);
  return v > 0 ? static_cast<int64_t>(v) : fallback;
}

// This core's L2 (1 MB where the C library does not say): the next set is prefetched only where it fits beside
// the packed one (at 11008 inputs it did not, and the prefetch evicted the pack: measured slower)
inline int64_t l2_bytes() {
  static const int64_t bytes = cache_bytes(_SC_LEVEL2_CACHE_SIZE, int64_t{1} << 20);
  return bytes;
}

template <int RB, int T>
CAST_AVX512_BF16 void rows_tile(const __m512i* Wp, const __m512i* Ip, const uint16_t* x, int64_t K, int64_t t0,
                                const float* bias, const float* scale, uint16_t* y, int64_t N, int64_t r0,
                                RowsAhead next) {
  const int64_t G = K / 4;
  const int64_t lines = (next.row_bytes + 63) / 64;
  int64_t pf_row = 0, pf_line = 0;
  __m512 acc[RB][T];
  for (int b = 0; b < RB; ++b)
    for (int t = 0; t < T; ++t) acc[b][t] = _mm512_setzero_ps();
  const uint16_t* xt[T];
  for (int t = 0; t < T; ++t) xt[t] = x + (t0 + t) * K;
  for (int64_t g = 0; g < G; ++g) {
    if (next.base && pf_row < next.rows)
      for (int j = 0; j < 3; ++j) {
        _mm_prefetch(next.base + pf_row * next.row_bytes + 64 * pf_line, _MM_HINT_T1);
        if (++pf_line == lines) {
          pf_line = 0;
          if (++pf_row == next.rows) break;
        }
      }
    __m512i w[RB], id[RB];
    for (int b = 0; b < RB; ++b) {
      w[b] = _mm512_load_si512(Wp + g * RB + b);
      id[b] = _mm512_load_si512(Ip + g * RB + b);
    }
    for (int t = 0; t < T; ++t) {
      long long q;
      std::memcpy(&q, xt[t] + 4 * g, 8);
      const __m512i xb = _mm512_set1_epi64(q);
      for (int b = 0; b < RB; ++b)
        acc[b][t] = _mm512_dpbf16_ps(acc[b][t], (__m512bh)_mm512_permutexvar_epi16(id[b], xb), (__m512bh)w[b]);
    }
  }
  for (int b = 0; b < RB; ++b) {
    const int64_t rb = r0 + 16 * b, n = std::min<int64_t>(16, N - rb);
    const __mmask16 m = n == 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + rb) : _mm512_setzero_ps();
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(m, scale + rb) : _mm512_set1_ps(1.f);
    for (int t = 0; t < T; ++t)
      _mm256_mask_storeu_epi16(y + (t0 + t) * N + rb, m,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[b][t], sv, bv)));
  }
}

using RowsTileFn = void (*)(const __m512i*, const __m512i*, const uint16_t*, int64_t, int64_t, const float*,
                            const float*, uint16_t*, int64_t, int64_t, RowsAhead);
template <int RB, int... Ts>
constexpr std::array<RowsTileFn, sizeof...(Ts)> rows_tiles(std::integer_sequence<int, Ts...>) {
  return {&rows_tile<RB, Ts + 1>...};
}
const std::array<std::array<RowsTileFn, kRowTokens>, kRowBlocks> kRowsTable = {
    rows_tiles<1>(std::make_integer_sequence<int, kRowTokens>{}),
    rows_tiles<2>(std::make_integer_sequence<int, kRowTokens>{}),
    rows_tiles<3>(std::make_integer_sequence<int, kRowTokens>{})};

void sparse24_mm_rows(const uint16_t* x, const void* values, int kind, const uint8_t* meta, const float* scale,
                      const float* bias, uint16_t* y, int64_t M, int64_t N, int64_t K) {
  const int64_t vb = kind == kBF16 ? 2 : 1;
  const int64_t G = K / 4, set_rows = 16 * kRowBlocks, sets = (N + set_rows - 1) / set_rows;
  at::parallel_for(0, sets, 1, [&](int64_t s0, int64_t s1) {
    std::vector<uint8_t> hold(static_cast<size_t>(2 * G * kRowBlocks * 64 + 64));
    __m512i* Wp = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(hold.data()) + 63) & ~uintptr_t{63});
    __m512i* Ip = Wp + G * kRowBlocks;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r0 = s * set_rows;
      const int RB = static_cast<int>(std::min<int64_t>(kRowBlocks, (N - r0 + 15) / 16));
      if (kind == kBF16) rows_pack<kBF16>(values, meta, N, K, r0, RB, Wp, Ip);
      else rows_pack<kI8>(values, meta, N, K, r0, RB, Wp, Ip);
      RowsAhead next;
      if (s + 1 < s1 && 144 * K <= l2_bytes() * 3 / 4) {  // this set packed (96 K bytes) + the next's values (48 K)
        next.base = static_cast<const char*>(values) + (r0 + set_rows) * (K / 2) * vb;
        next.row_bytes = (K / 2) * vb;
        next.rows = std::min<int64_t>(set_rows, N - r0 - set_rows);
      }
      for (int64_t t0 = 0; t0 < M; t0 += kRowTokens) {
        const int T = static_cast<int>(std::min<int64_t>(kRowTokens, M - t0));
        kRowsTable[RB - 1][T - 1](Wp, Ip, x, K, t0, bias, scale, y, N, r0, t0 == 0 ? next : RowsAhead{});
      }
    }
  });
}

// ----------------------------------------------------------------------------------------------- driver
enum Isa { kAvx512Bf16 = 0, kAvx512 = 1, kAvx2 = 2, kAmxBf16 = 3, kAvx512Bf16Rows = 5,
           kAvx512Bf16Hw = 6, kAvx2Hw = 7, kAvx2Tokens = 8 };  // (4: a removed path)

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kAvx512Bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case kAvx2:
    case kAvx2Hw:
    case kAvx2Tokens:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAmxBf16:
      return isa_supported(kAvx512Bf16) && amx_cpu() && amx_permitted();
    case kAvx512Bf16Rows:
    case kAvx512Bf16Hw:
      return isa_supported(kAvx512Bf16);
    default:
      return false;
  }
}

using BlockFn = void (*)(const void*, const uint8_t*, const void*, float*, int64_t, int64_t, int64_t, int64_t);

template <int Kind, int R, int T, bool SwPf>
void bf16_block(const void* v, const uint8_t* m, const void* x, float* o, int64_t n0, int64_t t0, int64_t K,
                int64_t N) {
  block_avx512_bf16<R, T, Kind, SwPf>(v, m, static_cast<const uint16_t*>(x), o, n0, t0, K, N);
}
template <int Kind, int R, int T>
void f32_block512(const void* v, const uint8_t* m, const void* x, float* o, int64_t n0, int64_t t0, int64_t K,
                  int64_t N) {
  block_avx512<Kind, R, T>(v, m, static_cast<const float*>(x), o, n0, t0, K, N);
}
template <int Kind, int R, int T, bool SwPf>
void f32_block256(const void* v, const uint8_t* m, const void* x, float* o, int64_t n0, int64_t t0, int64_t K,
                  int64_t N) {
  block_avx2<Kind, R, T, SwPf>(v, m, static_cast<const float*>(x), o, n0, t0, K, N);
}

// table[R - 1][T - 1] for one (isa, kind)
struct Table {
  BlockFn fn[4][4];
};

template <template <int, int> class Make>
Table make_table() {
  Table t;
  t.fn[0][0] = Make<1, 1>::f; t.fn[0][1] = Make<1, 2>::f; t.fn[0][2] = Make<1, 3>::f; t.fn[0][3] = Make<1, 4>::f;
  t.fn[1][0] = Make<2, 1>::f; t.fn[1][1] = Make<2, 2>::f; t.fn[1][2] = Make<2, 3>::f; t.fn[1][3] = Make<2, 4>::f;
  t.fn[2][0] = Make<3, 1>::f; t.fn[2][1] = Make<3, 2>::f; t.fn[2][2] = Make<3, 3>::f; t.fn[2][3] = Make<3, 4>::f;
  t.fn[3][0] = Make<4, 1>::f; t.fn[3][1] = Make<4, 2>::f; t.fn[3][2] = Make<4, 3>::f; t.fn[3][3] = Make<4, 4>::f;
  return t;
}

template <int Kind, bool SwPf = true> struct MakeBf16 { template <int R, int T> struct M { static constexpr BlockFn f = &bf16_block<Kind, R, T, SwPf>; }; };
template <int Kind> struct Make512 { template <int R, int T> struct M { static constexpr BlockFn f = &f32_block512<Kind, R, T>; }; };
template <int Kind, bool SwPf = true> struct Make256 { template <int R, int T> struct M { static constexpr BlockFn f = &f32_block256<Kind, R, T, SwPf>; }; };

const Table& table_for(int64_t isa, int kind) {
  static const Table bf16[3] = {make_table<MakeBf16<kBF16>::M>(), make_table<MakeBf16<kBF16>::M>(),
                                make_table<MakeBf16<kI8>::M>()};  // (no fp32 values on this path)
  static const Table bf16hw[3] = {make_table<MakeBf16<kBF16, false>::M>(), make_table<MakeBf16<kBF16, false>::M>(),
                                  make_table<MakeBf16<kI8, false>::M>()};
  static const Table a512[3] = {make_table<Make512<kBF16>::M>(), make_table<Make512<kF32>::M>(),
                                make_table<Make512<kI8>::M>()};
  static const Table a256[3] = {make_table<Make256<kBF16>::M>(), make_table<Make256<kF32>::M>(),
                                make_table<Make256<kI8>::M>()};
  static const Table a256hw[3] = {make_table<Make256<kBF16, false>::M>(), make_table<Make256<kF32, false>::M>(),
                                  make_table<Make256<kI8, false>::M>()};
  if (isa == kAvx512Bf16) return bf16[kind];
  if (isa == kAvx512Bf16Hw) return bf16hw[kind];
  if (isa == kAvx512) return a512[kind];
  if (isa == kAvx2Hw) return a256hw[kind];
  return a256[kind];
}

// rows of W a block: one for a single token, four otherwise. Measured (docs/results/cpu24-notes.md §2-4): at
// one token, four rows a block read eight streams at once and ran 23 GB/s on one core, one row (two streams)
// 24-28 GB/s; at 4 and 16 tokens one row a block recomputes the indices and reloads x for every row and ran
// 0.5-0.7x the four-row block. Since one row prefetches 8 KB ahead (§14), the bf16 gather path also takes one
// row a block for 2-4 tokens where their activations fit L1 (§16: 30-40 % less time at 4096 inputs and 4
// tokens; at 11008 inputs, where they do not fit, one row a block ran twice as long).
constexpr int64_t kRows = 4;
constexpr int64_t kTokens = 4;  // rows of x a block

// This core's L1 data cache (32 KB where the C library does not say)
inline int64_t l1_bytes() {
  static const int64_t bytes = cache_bytes(_SC_LEVEL1_DCACHE_SIZE, int64_t{32} << 10);
  return bytes;
}

#ifndef CAST_ROWS1  // rows a block at one token (the A/B of cpu24-notes.md §25)
#define CAST_ROWS1 1
#endif
inline int64_t rows_per_block(int64_t tokens, int64_t K, bool bf16_gather) {
  if (tokens == 1) return CAST_ROWS1;
  if (bf16_gather && tokens <= kTokens && tokens * K * 2 <= l1_bytes()) return 1;
  return kRows;
}

// K-blocking for 2-4 tokens whose activations take more than 3/4 of L1 (bf16 gather path): K is cut into chunks
// whose activations take at most that, and each thread visits its rows chunk by chunk, one row at a time, summing
// the chunks' fp32 products per row (the step order within a row is unchanged, the sum over chunks added). Probe
// before it was built (docs/results/cpu24-notes.md §20, 4096×11008, 1 thread): 4 tokens 2.66 -> 1.72 ms, 2 tokens
// 3.40 -> 1.61 ms against the four-row block. 1 = not K-blocked.
#ifndef CAST_KBLOCK  // -DCAST_KBLOCK=0 builds without it (the A/B of §20)
#define CAST_KBLOCK 1
#endif
#ifndef CAST_KBLOCK_PCT  // the activations' share of L1 above which (and to which) K is cut
#define CAST_KBLOCK_PCT 75
#endif
// One token: its activations cut to at most this share of L1 (0, the build: never). On a 32 KB-L1 core one token
// of 11008 inputs (22 KB, 69 % of L1) ran 1.27-1.46x faster as two separately compressed weights of 5504 inputs
// (the probe of cpu24-notes.md §28), but this loop's visits of the row-major layout (each row's 5.5 KB piece, then
// the next row's) ran 1.3-1.5x slower than one pass (§28's A/B, -DCAST_KBLOCK1_PCT=50): the gain needs the
// chunk-major layout of the probe, which every path would have to read. Kept for reruns of that A/B.
#ifndef CAST_KBLOCK1_PCT
#define CAST_KBLOCK1_PCT 0
#endif
inline int64_t k_chunks(int64_t M, int64_t K) {
  if (!CAST_KBLOCK) return 1;
  const int64_t full = K / 64;
  // the rest of L1 is room for the values' lines: 2 tokens × 11008 inputs (44 KB of a 48 KB L1) ran one row a
  // block at 3.40 ms, in two chunks 1.61 (§20); cut at 1/2 of L1 the 4096-input shapes ran 1.3-1.6x slower
  const int64_t budget = l1_bytes() * (M == 1 ? CAST_KBLOCK1_PCT : CAST_KBLOCK_PCT) / 100;
  if (M < 1 || M > kTokens || budget <= 0 || M * K * 2 <= budget || full < 2) return 1;
  const int64_t want = std::min(full, (M * K * 2 + budget - 1) / budget);
  const int64_t len = (full + want - 1) / want;  // steps a chunk; no chunk left empty
  return (full + len - 1) / len;
}

using ChunkFn = void (*)(const void*, const uint8_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t,
                         bool, PfAhead);

template <bool SwPf>
struct ChunkFns {  // [int8 values][tokens - 1]
  static constexpr ChunkFn fn[2][4] = {
      {&chunk_rows_bf16<1, 1, kBF16, SwPf>, &chunk_rows_bf16<1, 2, kBF16, SwPf>, &chunk_rows_bf16<1, 3, kBF16, SwPf>,
       &chunk_rows_bf16<1, 4, kBF16, SwPf>},
      {&chunk_rows_bf16<1, 1, kI8, SwPf>, &chunk_rows_bf16<1, 2, kI8, SwPf>, &chunk_rows_bf16<1, 3, kI8, SwPf>,
       &chunk_rows_bf16<1, 4, kI8, SwPf>}};
};

void sparse24_mm_kblocked(const uint16_t* x, const void* values, int kind, const uint8_t* meta, const float* scale,
                          const float* bias, uint16_t* y, int64_t M, int64_t N, int64_t K, bool sw_pf) {
  // one row at a time (two rows a block measured slower: §20); the hwpf path without software prefetch at one
  // token (-DCAST_KBLOCK1_PCT only); 2-4 tokens prefetch on both paths (without it 1.6x slower at 4 tokens, §28)
  const ChunkFn fn = (sw_pf ? ChunkFns<true>::fn : ChunkFns<false>::fn)[kind == kI8 ? 1 : 0][M - 1];
  const int64_t full = K / 64, chunks = k_chunks(M, K), len = (full + chunks - 1) / chunks;
  const int64_t grain = std::max<int64_t>(16, (16 * 4096) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(static_cast<size_t>((b1 - b0) * M), 0.0f);  // [row][token]
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t s0 = c * len, s1 = std::min(full, s0 + len);
      const bool tail = c == chunks - 1;
      const int64_t span = s1 - s0;
      for (int64_t n = b0; n < b1; ++n) {
        const PfAhead ahead{n + CAST_PF_GATHER / span, s0 + CAST_PF_GATHER % span};
        fn(values, meta, x, acc.data() + (n - b0) * M, n, K, s0, s1, tail, ahead);
      }
    }
    for (int64_t n = b0; n < b1; ++n)
      for (int64_t t = 0; t < M; ++t) store_out(acc[(n - b0) * M + t], n, t * N + n, scale, bias, true, y);
  });
}

// The loop both GEMMs share: threads over blocks of output rows, token blocks inside; ``block(res, n0, t0, R, T)``
// fills res[t * R + r] with fp32 sums, which are scaled (int8 values), biased and rounded once into y (M, N).
template <class Block>
void run_blocks(int64_t M, int64_t N, int64_t rb, int64_t grain, const Block& block, const float* scale,
                const float* bias, bool out_bf16, void* y) {
  const int64_t blocks = (N + rb - 1) / rb;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    float res[kRows * kTokens];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * rb;
      const int64_t R = std::min(rb, N - n0);
      for (int64_t t0 = 0; t0 < M; t0 += kTokens) {
        const int64_t T = std::min(kTokens, M - t0);
        block(res, n0, t0, R, T);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t r = 0; r < R; ++r)
            store_out(res[t * R + r], n0 + r, (t0 + t) * N + n0 + r, scale, bias, out_bf16, y);
      }
    }
  });
}

static at::Tensor sparse24_mm_2d(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta,
                                 const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                                 int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && values.device().is_cpu() && meta.device().is_cpu(),
              "sparse24_mm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && values.dim() == 2 && meta.dim() == 2, "sparse24_mm: 2-D x, values and meta");
  const int64_t M = x.size(0), K = x.size(1), N = values.size(0);
  TORCH_CHECK(K % 4 == 0, "sparse24_mm: in_features must be a multiple of 4, got ", K);
  TORCH_CHECK(values.size(1) == K / 2, "sparse24_mm: values must be (out, in/2)");
  TORCH_CHECK(meta.scalar_type() == at::kByte && meta.size(0) == N && meta.size(1) == (K + 7) / 8,
              "sparse24_mm: meta must be uint8 (out, ceil(in/8))");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "sparse24_mm: bf16 or fp32 x");
  TORCH_CHECK(isa_supported(isa), "sparse24_mm: this CPU lacks the instructions of path ", isa);
  int kind;
  switch (values.scalar_type()) {
    case at::kBFloat16: kind = kBF16; break;
    case at::kFloat: kind = kF32; break;
    case at::kChar: kind = kI8; break;
    default: TORCH_CHECK(false, "sparse24_mm: values must be bf16, fp32 or int8");
  }
  TORCH_CHECK(kind != kI8 || (scale.has_value() && scale->scalar_type() == at::kFloat && scale->numel() == N),
              "sparse24_mm: int8 values need an fp32 scale of out entries");
  TORCH_CHECK((isa != kAvx512Bf16 && isa != kAvx512Bf16Hw) || (kind != kF32 && x.scalar_type() == at::kBFloat16),
              "sparse24_mm: the avx512-bf16 path takes bf16 x and bf16 or int8 values");
  TORCH_CHECK(isa != kAmxBf16 || (kind == kBF16 && x.scalar_type() == at::kBFloat16),
              "sparse24_mm: the amx-bf16 path takes bf16 x and bf16 values");
  TORCH_CHECK(isa != kAvx512Bf16Rows || (kind != kF32 && x.scalar_type() == at::kBFloat16),
              "sparse24_mm: the avx512-bf16-rows path takes bf16 x and bf16 or int8 values");
  if (bias.has_value()) TORCH_CHECK(bias->numel() == N, "sparse24_mm: bias must have out entries");

  const at::Tensor xc = x.contiguous(), vc = values.contiguous(), mc = meta.contiguous();
  // fp32 paths read fp32 activations: a bf16 x is widened once per call (M x K, from L1/L2)
  const bool bf16_x_path = isa == kAvx512Bf16 || isa == kAvx512Bf16Hw || isa == kAmxBf16 ||
                           isa == kAvx512Bf16Rows;
  const bool avx2_loop = isa == kAvx2 || isa == kAvx2Hw;
  at::Tensor xa = (bf16_x_path || avx2_loop || x.scalar_type() == at::kFloat) ? xc : xc.to(at::kFloat);
  if (avx2_loop) {  // the AVX2 steps read each token's activations in their own layout (bf16 widened on the way)
    at::Tensor laid = at::empty({M, K}, x.options().dtype(at::kFloat));
    for (int64_t t = 0; t < M; ++t) {
      if (x.scalar_type() == at::kBFloat16)
        avx2_layout_x_bf16(static_cast<const uint16_t*>(xc.data_ptr()) + t * K, laid.data_ptr<float>() + t * K, K);
      else
        avx2_layout_x(xc.data_ptr<float>() + t * K, laid.data_ptr<float>() + t * K, K);
    }
    xa = laid;
  }
  at::Tensor bias_f, scale_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  if (scale.has_value()) scale_f = scale->contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (isa == kAvx2Tokens) {  // lanes over tokens: the activations transposed once per call
    const int64_t L = token_lanes(M);
    at::Tensor xt = at::empty({(M + L - 1) / L * L * K}, xa.options());
    avx2_tokens_layout(xa.data_ptr<float>(), xt.data_ptr<float>(), M, K, L);
    const float* xp = xt.data_ptr<float>();
    const void* vp = vc.data_ptr();
    const uint8_t* mp = mc.data_ptr<uint8_t>();
    const float* sp = scale.has_value() ? scale_f.data_ptr<float>() : nullptr;
    const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
    const bool ob = x.scalar_type() == at::kBFloat16;
    void* yp = y.data_ptr();
    if (L == 8) {
      if (kind == kBF16) sparse24_mm_avx2_tokens<kBF16, 1>(xp, vp, mp, sp, bp, yp, ob, M, N, K);
      else if (kind == kF32) sparse24_mm_avx2_tokens<kF32, 1>(xp, vp, mp, sp, bp, yp, ob, M, N, K);
      else sparse24_mm_avx2_tokens<kI8, 1>(xp, vp, mp, sp, bp, yp, ob, M, N, K);
    } else {
      if (kind == kBF16) sparse24_mm_avx2_tokens<kBF16, 2>(xp, vp, mp, sp, bp, yp, ob, M, N, K);
      else if (kind == kF32) sparse24_mm_avx2_tokens<kF32, 2>(xp, vp, mp, sp, bp, yp, ob, M, N, K);
      else sparse24_mm_avx2_tokens<kI8, 2>(xp, vp, mp, sp, bp, yp, ob, M, N, K);
    }
    return y;
  }
  if (isa == kAmxBf16) {
    sparse24_mm_amx(static_cast<const uint16_t*>(xc.data_ptr()), static_cast<const uint16_t*>(vc.data_ptr()),
                    mc.data_ptr<uint8_t>(), bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
                    static_cast<uint16_t*>(y.data_ptr()), M, N, K);
    return y;
  }
  if (isa == kAvx512Bf16Rows) {
    sparse24_mm_rows(static_cast<const uint16_t*>(xc.data_ptr()), vc.data_ptr(), kind, mc.data_ptr<uint8_t>(),
                     scale.has_value() ? scale_f.data_ptr<float>() : nullptr,
                     bias.has_value() ? bias_f.data_ptr<float>() : nullptr, static_cast<uint16_t*>(y.data_ptr()), M,
                     N, K);
    return y;
  }
  // (2-4 tokens K-blocked where their activations crowd L1, one token only with -DCAST_KBLOCK1_PCT: one loop with
  // its own prefetch, none for the hwpf path at one token)
  if ((isa == kAvx512Bf16 || isa == kAvx512Bf16Hw) && k_chunks(M, K) > 1) {
    sparse24_mm_kblocked(static_cast<const uint16_t*>(xc.data_ptr()), vc.data_ptr(), kind, mc.data_ptr<uint8_t>(),
                         scale.has_value() ? scale_f.data_ptr<float>() : nullptr,
                         bias.has_value() ? bias_f.data_ptr<float>() : nullptr, static_cast<uint16_t*>(y.data_ptr()),
                         M, N, K, isa == kAvx512Bf16 || M > 1);
    return y;
  }
  const Table& table = table_for(isa, kind);
  const void* vptr = vc.data_ptr();
  const uint8_t* mptr = mc.data_ptr<uint8_t>();
  const void* xptr = xa.data_ptr();
  const float* bptr = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const float* sptr = scale.has_value() ? scale_f.data_ptr<float>() : nullptr;
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  void* yptr = y.data_ptr();
  // a thread's share should be worth the fork: ~64 rows of a 4096-input layer
  const int64_t grain = std::max<int64_t>(1, (16 * 4096) / std::max<int64_t>(K, 1) / std::max<int64_t>(M, 1));
  run_blocks(M, N, rows_per_block(M, K, isa == kAvx512Bf16 || isa == kAvx512Bf16Hw), grain,
             [&](float* res, int64_t n0, int64_t t0, int64_t R, int64_t T) {
    table.fn[R - 1][T - 1](vptr, mptr, xptr, res, n0, t0, K, N);
  }, sptr, bptr, out_bf16, yptr);
  return y;
}

// A dense GEMV written with the same care (the honest baseline of benchmarks/cpu24.py, and a dense path
// where it beats torch's): bf16 W (N, K) and bf16 x, vdpbf16ps, four rows at a time, threads over rows.
template <int R, int T>
CAST_AVX512_BF16 void dense_block_bf16(const uint16_t* w, const uint16_t* x, float* out, int64_t n0, int64_t t0,
                                       int64_t K) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t steps = (K + 31) / 32;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t rest = K - s * 32 >= 32 ? 32 : K - s * 32;
    const __mmask32 m = rest == 32 ? 0xffffffffu : ((1u << rest) - 1);
    __m512i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_epi16(m, x + (t0 + t) * K + s * 32);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(m, w + (n0 + r) * K + s * 32);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv, (__m512bh)xv[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// The same on AVX2 (CPUs without AVX512-BF16): bf16 W widened to fp32 in registers, fp32 x (converted once per
// call), FMA; tiles of at most 2 rows x 2 tokens, two accumulators at one row and token, as the 2:4 AVX2 path.
template <int R, int T>
CAST_AVX2 inline __attribute__((always_inline)) void dense_step_avx2(const uint16_t* w, const float* x,
                                                                     __m256 (&acc)[R][T], int64_t k, int64_t n0,
                                                                     int64_t t0, int64_t K) {
  __m256 wv[R];
  for (int r = 0; r < R; ++r) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + r) * K + k));
    wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  for (int t = 0; t < T; ++t) {
    const __m256 xv = _mm256_loadu_ps(x + (t0 + t) * K + k);
    for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
  }
}

template <int R, int T>
CAST_AVX2 void dense_tile_avx2(const uint16_t* w, const float* x, float* out, int64_t n0, int64_t t0, int64_t K,
                               int R_all, int r_off, int t_off) {
  constexpr int U = (R == 1 && T == 1) ? 2 : 1;
  __m256 acc[U][R][T];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[u][r][t] = _mm256_setzero_ps();
  const int64_t full = K / 8;
  int64_t s = 0;
  for (; s + U <= full; s += U)
    for (int u = 0; u < U; ++u) dense_step_avx2<R, T>(w, x, acc[u], (s + u) * 8, n0 + r_off, t0 + t_off, K);
  for (; s < full; ++s) dense_step_avx2<R, T>(w, x, acc[0], s * 8, n0 + r_off, t0 + t_off, K);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      __m256 a = acc[0][r][t];
      if (U == 2) a = _mm256_add_ps(a, acc[U - 1][r][t]);
      float tail = 0.f;
      for (int64_t k = full * 8; k < K; ++k)
        tail += bf16_to_f32(w[(n0 + r_off + r) * K + k]) * x[(t0 + t_off + t) * K + k];
      out[(t_off + t) * R_all + r_off + r] = hsum256(a) + tail;
    }
}

template <int R, int T>
CAST_AVX2 void dense_block_avx2(const uint16_t* w, const float* x, float* out, int64_t n0, int64_t t0, int64_t K) {
  in_tiles_2x2(R, T, [&](auto rt, auto tt, int r, int t) {
    dense_tile_avx2<decltype(rt)::value, decltype(tt)::value>(w, x, out, n0, t0, K, R, r, t);
  });
}

at::Tensor dense_mm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "dense_mm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "dense_mm: bf16 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "dense_mm: (M, K) x (N, K)");
  const bool bf16_path = isa_supported(kAvx512Bf16);
  TORCH_CHECK(bf16_path || isa_supported(kAvx2), "dense_mm: this CPU has neither AVX512-BF16 nor AVX2+FMA");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor xc = bf16_path ? x.contiguous() : x.contiguous().to(at::kFloat), wc = weight.contiguous();
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  const void* xp = xc.data_ptr();
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (8 * 4096) / std::max<int64_t>(K, 1) / std::max<int64_t>(M, 1));
  run_blocks(M, N, rows_per_block(M, K, false), grain,
             [&](float* res, int64_t n0, int64_t t0, int64_t R, int64_t T) {
#define CAST_DENSE_CASE(RR, TT)                                                                          \
  if (R == RR && T == TT) {                                                                               \
    if (bf16_path) dense_block_bf16<RR, TT>(wp, static_cast<const uint16_t*>(xp), res, n0, t0, K);       \
    else dense_block_avx2<RR, TT>(wp, static_cast<const float*>(xp), res, n0, t0, K);                    \
  }
    CAST_DENSE_CASE(4, 4) CAST_DENSE_CASE(4, 3) CAST_DENSE_CASE(4, 2) CAST_DENSE_CASE(4, 1)
    CAST_DENSE_CASE(3, 4) CAST_DENSE_CASE(3, 3) CAST_DENSE_CASE(3, 2) CAST_DENSE_CASE(3, 1)
    CAST_DENSE_CASE(2, 4) CAST_DENSE_CASE(2, 3) CAST_DENSE_CASE(2, 2) CAST_DENSE_CASE(2, 1)
    CAST_DENSE_CASE(1, 4) CAST_DENSE_CASE(1, 3) CAST_DENSE_CASE(1, 2) CAST_DENSE_CASE(1, 1)
#undef CAST_DENSE_CASE
  }, nullptr, bp, true, y.data_ptr());
  return y;
}

// One bf16 row rebuilt 32 inputs a step with AVX512-VBMI2: four position bytes -> the step's 32-bit dense mask
// (kMaskLut), vpexpandw places the 16 kept values at their positions and zeros elsewhere; the 4..28 inputs
// past the last whole step by the scalar loop of unpack24_out
#define CAST_VBMI2 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2")))
CAST_VBMI2 int64_t unpack_row_vbmi2(const uint16_t* v, const uint8_t* m, uint16_t* out, int64_t K) {
  const int64_t whole = K / 32;
  for (int64_t c = 0; c < whole; ++c) {
    const uint32_t mask = static_cast<uint32_t>(kMaskLut.m[m[4 * c]]) | (static_cast<uint32_t>(kMaskLut.m[m[4 * c + 1]]) << 8) |
                          (static_cast<uint32_t>(kMaskLut.m[m[4 * c + 2]]) << 16) |
                          (static_cast<uint32_t>(kMaskLut.m[m[4 * c + 3]]) << 24);
    const __m512i kept = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c)));
    _mm512_storeu_si512(out + 32 * c, _mm512_maskz_expand_epi16(mask, kept));
  }
  return whole * 8;  // groups done
}

bool has_vbmi2() { return isa_supported(kAvx512) && __builtin_cpu_supports("avx512vbmi2"); }

// The dense weight rebuilt from the compressed form into ``out`` (N, K) — for large token counts, where a dense
// GEMM outruns the gather kernels: the layer keeps only the compressed bytes and rebuilds into one shared
// scratch buffer per shape, then calls torch's dense GEMM. bf16 rows 32 inputs a vpexpandw where the CPU has AVX512-VBMI2,
// otherwise (and fp32, and the tail of a row) one 8-byte (bf16) or two (fp32) stores a group.
void unpack24_out(const at::Tensor& out, const at::Tensor& values, const at::Tensor& meta) {
  TORCH_CHECK(out.is_contiguous() && values.is_contiguous() && meta.is_contiguous(), "unpack24: contiguous tensors");
  TORCH_CHECK(out.scalar_type() == values.scalar_type(), "unpack24: out and values of one dtype");
  TORCH_CHECK(values.scalar_type() == at::kBFloat16 || values.scalar_type() == at::kFloat, "unpack24: bf16 or fp32");
  const int64_t N = out.size(0), K = out.size(1), G = K / 4, mbytes = (K + 7) / 8;
  TORCH_CHECK(values.size(0) == N && values.size(1) == K / 2 && meta.size(0) == N && meta.size(1) == mbytes,
              "unpack24: shapes do not match");
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  const bool bf16 = values.scalar_type() == at::kBFloat16;
  const void* vp = values.data_ptr();
  void* op = out.data_ptr();
  static const bool vbmi2 = has_vbmi2();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* m = mp + n * mbytes;
      int64_t g0 = 0;
      if (bf16 && vbmi2)
        g0 = unpack_row_vbmi2(static_cast<const uint16_t*>(vp) + n * (K / 2), m, static_cast<uint16_t*>(op) + n * K, K);
      for (int64_t g = g0; g < G; ++g) {
        const unsigned nib = (m[g / 2] >> (4 * (g % 2))) & 15u;
        const unsigned p0 = nib & 3u, p1 = nib >> 2;
        if (bf16) {
          const uint16_t* v = static_cast<const uint16_t*>(vp) + n * (K / 2) + 2 * g;
          const uint64_t word = (static_cast<uint64_t>(v[0]) << (16 * p0)) | (static_cast<uint64_t>(v[1]) << (16 * p1));
          std::memcpy(static_cast<uint16_t*>(op) + n * K + 4 * g, &word, 8);
        } else {
          const float* v = static_cast<const float*>(vp) + n * (K / 2) + 2 * g;
          float quad[4] = {0.f, 0.f, 0.f, 0.f};
          quad[p0] = v[0];
          quad[p1] = v[1];
          std::memcpy(static_cast<float*>(op) + n * K + 4 * g, quad, 16);
        }
      }
    }
  });
}

bool cpu_supports(int64_t isa) { return isa_supported(isa); }

}  // namespace

// the K-chunks of the avx512-bf16 path at this token count and input width (1: not K-blocked), for tests/reports
int64_t k_chunks_op(int64_t tokens, int64_t in_features) { return k_chunks(tokens, in_features); }

// x of any leading shape (..., in), flattened to rows here, the output (..., out) as F.linear gives it: a layer's
// forward hands the op its input as it comes, with no reshape and view around the call in Python (~2 µs a call,
// which decides small layers at one token: docs/results/cpu24-notes.md §38)
at::Tensor sparse24_mm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta,
                       const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias, int64_t isa) {
  if (x.dim() == 2) return sparse24_mm_2d(x, values, meta, scale, bias, isa);
  TORCH_CHECK(x.dim() >= 1, "sparse24_mm: x must have at least one dimension");
  const at::Tensor y = sparse24_mm_2d(x.reshape({-1, x.size(-1)}), values, meta, scale, bias, isa);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = y.size(1);
  return y.view(sizes);
}

TORCH_LIBRARY(cast_llm_cpu24, m) {
  m.def("sparse24_mm(Tensor x, Tensor values, Tensor meta, Tensor? scale, Tensor? bias, int isa) -> Tensor");
  m.def("dense_mm(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("unpack24_out(Tensor(a!) out, Tensor values, Tensor meta) -> ()");
  m.def("cpu_supports(int isa) -> bool", &cpu_supports);
  m.def("k_chunks(int tokens, int in_features) -> int", &k_chunks_op);
}

TORCH_LIBRARY_IMPL(cast_llm_cpu24, CPU, m) {
  m.impl("sparse24_mm", &sparse24_mm);
  m.impl("dense_mm", &dense_mm);
  m.impl("unpack24_out", &unpack24_out);
}
