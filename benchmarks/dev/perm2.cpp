#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define T __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16,avx512vbmi2,avx512vl"), noinline))
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
#define BODY(OP) \
  __m512i a0=_mm512_set1_epi32(1),a1=_mm512_set1_epi32(2),a2=_mm512_set1_epi32(3),a3=_mm512_set1_epi32(4),a4=_mm512_set1_epi32(5),a5=_mm512_set1_epi32(6),a6=_mm512_set1_epi32(7),a7=_mm512_set1_epi32(8); \
  double t0 = now(); \
  for (long i = 0; i < n; ++i) { OP(a0); OP(a1); OP(a2); OP(a3); OP(a4); OP(a5); OP(a6); OP(a7); } \
  double t = (now() - t0) / n / 8; \
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)),_mm512_add_epi32(_mm512_add_epi32(a4,a5),_mm512_add_epi32(a6,a7))); \
  sink += _mm512_reduce_add_epi32(s); return t;
volatile int sink;
T double t_add(long n, __m512i b, __m512i idx) {
#define OP(x) x = _mm512_add_epi32(x, b)
  BODY(OP)
#undef OP
}
T double t_p2w(long n, __m512i b, __m512i idx) {
#define OP(x) x = _mm512_permutex2var_epi16(x, idx, b)
  BODY(OP)
#undef OP
}
T double t_p1w(long n, __m512i b, __m512i idx) {
#define OP(x) x = _mm512_permutexvar_epi16(idx, x)
  BODY(OP)
#undef OP
}
T double t_p2b(long n, __m512i b, __m512i idx) {
#define OP(x) x = _mm512_permutex2var_epi8(x, idx, b)
  BODY(OP)
#undef OP
}
T double t_p1b(long n, __m512i b, __m512i idx) {
#define OP(x) x = _mm512_permutexvar_epi8(idx, x)
  BODY(OP)
#undef OP
}
T double t_dp(long n, __m512i b, __m512i idx) {
#define OP(x) x = (__m512i)_mm512_dpbf16_ps((__m512)x, (__m512bh)b, (__m512bh)idx)
  BODY(OP)
#undef OP
}
T double t_exp(long n, __m512i b, __m512i idx) {
#define OP(x) x = _mm512_maskz_expand_epi16(0x55555555u, _mm512_xor_si512(x, b))
  BODY(OP)
#undef OP
}
T double t_msq(long n, __m512i b, __m512i idx) {
#define OP(x) x = _mm512_multishift_epi64_epi8(idx, x)
  BODY(OP)
#undef OP
}
int main() {
  long n = 100000000;
  __m512i b = _mm512_set1_epi16(3), idx = _mm512_set1_epi16(5);
  double add = t_add(n, b, idx);
  printf("ns/op (8 chains): add %.3f vpermt2w %.3f vpermw %.3f vpermt2b %.3f vpermb %.3f dpbf16 %.3f expandw(+xor) %.3f multishift %.3f\n",
    add*1e9, t_p2w(n,b,idx)*1e9, t_p1w(n,b,idx)*1e9, t_p2b(n,b,idx)*1e9, t_p1b(n,b,idx)*1e9, t_dp(n,b,idx)*1e9, t_exp(n/4,b,idx)*1e9, t_msq(n,b,idx)*1e9);
}
