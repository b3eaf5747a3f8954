// Weight-only matrix products for decoding on a CPU: y (M, N) = x (M, K) @ W^T (+ bias), with W
// stored as float32, bfloat16, int8 (a scale per output) or int4 (a scale per output and group of
// 32 inputs). Built on first use by engine/inference/cpu_kernels.py; tested there against plain torch on
// every path the CPU can run.
//
// The blocked layout (all formats): the outputs in blocks of 16, each block's weights k-major,
// [N/16][K][16], so one vector load gives one k for 16 outputs and the product is a broadcast of
// x[k] times that vector: no horizontal sums, and the weights are read once, in order. int4
// packs two k into a byte: [N/16][K/2][16], k even in the low nibble, each value stored + 8
// (0..15); the group's scale multiplies its partial sum. The weights are unpacked to float32 in
// registers and multiplied by float32 activations.
//
// The VNNI layout (int8, int4 on AVX-512 VNNI): the activations are rounded to int8 per block
// of 32 inputs (a scale each, as llama.cpp's q8 blocks), and vpdpbusd sums four u8 x s8
// products into each int32 lane: 64 weights an instruction instead of 16. The weights are the
// unsigned operand: int8 stored + 128 as [N/16][K/4][16][4]; int4 stored + 8, 64 bytes per 8 k
// [N/16][K/8][16][4], the first 4 k in the low nibbles and the next 4 in the high ones. What
// the offsets add (128 or 8 times the block's sum of the rounded activations) is taken off.
//
// The pairs layout (bfloat16 on AVX-512 BF16): [N/16][K/2][16][2], two k of each output side
// by side, so vdpbf16ps multiplies 32 weights by a broadcast pair of activations (rounded to
// bfloat16, to nearest even) and adds both products into float32 lanes: half the instructions
// of unpacking to float32, and no unpacking.
//
// Five paths behind one op, chosen by `isa`: 0 portable C++, 1 AVX2 + FMA, 2 AVX-512 (F, BW,
// VL), 3 AVX-512 VNNI (int8, int4 in the VNNI layout), 4 AVX-512 BF16 (bfloat16, pairs layout). The vector paths are compiled with target
// attributes, so the library runs on any x86-64 and the caller picks what this CPU supports.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GPT2S_X86 1
#endif

namespace {

enum Format : int64_t { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };
constexpr int64_t BLOCK = 16;  // outputs per block
// the vector paths prefetch the weights this many bytes ahead of their loads: a core's own
// prefetcher left GPT-2's decode waiting on memory (AMD EPYC Zen 4, batch 1, 2048 -> 8192:
// float32 47 -> 59, bfloat16 103 -> 131, int8 176 -> 215 tok/s; 4096 and 16384 in between)
constexpr int64_t PREFETCH = 8192;

struct Problem {
  const float* x;       // (M, K)
  const void* w;        // packed
  const float* scales;  // int8: (N,); else unused
  const uint16_t* half_scales;  // int4: float16 (N / 16, K / group, 16), a block's together
  const float* bias;    // (N,) or nullptr
  const float* xsum;    // int4: (M, K / group), the sum of x over each group
  float* y;             // (M, N)
  int64_t M, K, N, group;
  Format format;
  // the VNNI path: x rounded to int8 per block of 32 inputs, its scales and sums
  const int8_t* xq = nullptr;   // (M, K)
  const float* xscale = nullptr;  // (M, K / 32)
  const int32_t* xqsum = nullptr;  // (M, K / 32)
  // the BF16 path: x rounded to bfloat16, two k as one 32-bit word
  const uint32_t* xpairs = nullptr;  // (M, K / 2)
};

constexpr int64_t QBLOCK = 32;  // inputs per activation scale on the VNNI path

// x (M, K) -> int8 per block of 32 (scale = max|x| / 127), the scales and the blocks' sums
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* scale, int32_t* sum) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < K / QBLOCK; ++j) {
      const float* v = x + m * K + j * QBLOCK;
      float peak = 0.f;
      for (int64_t i = 0; i < QBLOCK; ++i) peak = std::max(peak, std::abs(v[i]));
      const float s = peak / 127.f, inverse = peak > 0.f ? 127.f / peak : 0.f;
      int32_t total = 0;
      for (int64_t i = 0; i < QBLOCK; ++i) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
        xq[m * K + j * QBLOCK + i] = q;
        total += q;
      }
      scale[m * (K / QBLOCK) + j] = s;
      sum[m * (K / QBLOCK) + j] = total;
    }
  }
}

// x (M, K) -> bfloat16, rounded to nearest even as torch rounds (finite x), in pairs of k
void bf16_pairs(const float* x, int64_t count, uint32_t* pairs) {
  uint16_t* out = reinterpret_cast<uint16_t*>(pairs);
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    out[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

// ---- portable path: the reference the vector paths are tested against --------------------
float half_at(const uint16_t* h, int64_t at) {
  return c10::detail::fp16_ieee_to_fp32_value(h[at]);
}

float weight_at(const Problem& p, int64_t block, int64_t k, int64_t lane) {
  const int64_t at = (block * p.K + k) * BLOCK + lane;
  switch (p.format) {
    case F32: return static_cast<const float*>(p.w)[at];
    case BF16: {
      uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p.w)[at]) << 16;
      float value;
      std::memcpy(&value, &bits, sizeof value);
      return value;
    }
    case INT8: return static_cast<const int8_t*>(p.w)[at];
    case INT4: {
      uint8_t byte = static_cast<const uint8_t*>(p.w)[(block * (p.K / 2) + k / 2) * BLOCK + lane];
      return static_cast<float>((k % 2 ? byte >> 4 : byte & 15) - 8);
    }
  }
  return 0.f;
}

void blocks_portable(const Problem& p, int64_t begin, int64_t end) {
  const int64_t groups = p.format == INT4 ? p.K / p.group : 1;
  const int64_t width = p.format == INT4 ? p.group : p.K;
  for (int64_t b = begin; b < end; ++b) {
    for (int64_t m = 0; m < p.M; ++m) {
      for (int64_t lane = 0; lane < BLOCK; ++lane) {
        const int64_t n = b * BLOCK + lane;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          float part = 0.f;
          for (int64_t k = g * width; k < (g + 1) * width; ++k)
            part += weight_at(p, b, k, lane) * p.x[m * p.K + k];
          acc += p.format == INT4 ? part * half_at(p.half_scales, (b * groups + g) * BLOCK + lane)
                                  : part;
        }
        if (p.format == INT8) acc *= p.scales[n];
        p.y[m * p.N + n] = acc + (p.bias ? p.bias[n] : 0.f);
      }
    }
  }
}

#ifdef GPT2S_X86
// ---- AVX-512: one zmm holds a block's 16 outputs --------------------------------------------
// The products of one row form one chain of dependent FMAs; a few rows (decoding) keep U
// chains per row, over k, k+1, ..., so the FMA units are not left waiting on their latency.
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

AVX512 inline __m512 load16_half(const uint16_t* h) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

template <Format F>
AVX512 inline __m512 load16(const void* w, int64_t at) {
  if constexpr (F == F32) {
    return _mm512_loadu_ps(static_cast<const float*>(w) + at);
  } else if constexpr (F == BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint16_t*>(w) + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {  // INT8
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const int8_t*>(w) + at));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  }
}

// MB rows of x against one block: float32, bf16 and int8 weights (int8's scale at the end)
template <Format F, int MB, int U>
AVX512 void block_avx512(const Problem& p, int64_t b, int64_t m0) {
  __m512 acc[MB][U];
  for (int i = 0; i < MB; ++i)
    for (int u = 0; u < U; ++u) acc[i][u] = _mm512_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const int64_t base = b * p.K * BLOCK;
  constexpr int64_t size = F == F32 ? 4 : (F == BF16 ? 2 : 1);  // bytes a weight
  const char* bytes = static_cast<const char*>(p.w) + base * size;
  for (int64_t k = 0; k < p.K; k += U) {  // K is a multiple of U (the caller checks 8)
    _mm_prefetch(bytes + k * BLOCK * size + PREFETCH, _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      const __m512 w = load16<F>(p.w, base + (k + u) * BLOCK);
      for (int i = 0; i < MB; ++i)
        acc[i][u] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[i * p.K + k + u]), acc[i][u]);
    }
  }
  const int64_t n = b * BLOCK;
  const __m512 scale = F == INT8 ? _mm512_loadu_ps(p.scales + n) : _mm512_set1_ps(1.f);
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + n) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i) {
    __m512 sum = acc[i][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[i][u]);
    _mm512_storeu_ps(p.y + (m0 + i) * p.N + n, _mm512_fmadd_ps(sum, scale, bias));
  }
}

// int4: per group, the partial sum of (q + 8) * x, less 8 * sum(x), times the group's scale;
// the even and odd k of a byte are two chains
template <int MB>
AVX512 void block_avx512_int4(const Problem& p, int64_t b, int64_t m0) {
  __m512 acc[MB], even_part[MB], odd_part[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + b * (p.K / 2) * BLOCK;
  const __m512i low = _mm512_set1_epi32(15);
  const int64_t groups = p.K / p.group, n = b * BLOCK;
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < MB; ++i) even_part[i] = odd_part[i] = _mm512_setzero_ps();
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 2) {
      __m512i bytes = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k / 2) * BLOCK)));
      const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low));
      const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
      for (int i = 0; i < MB; ++i) {
        even_part[i] = _mm512_fmadd_ps(even, _mm512_set1_ps(x[i * p.K + k]), even_part[i]);
        odd_part[i] = _mm512_fmadd_ps(odd, _mm512_set1_ps(x[i * p.K + k + 1]), odd_part[i]);
      }
    }
    const __m512 scale = load16_half(p.half_scales + (b * groups + g) * BLOCK);
    for (int i = 0; i < MB; ++i) {
      const __m512 offset = _mm512_set1_ps(8.f * p.xsum[(m0 + i) * groups + g]);
      const __m512 part = _mm512_add_ps(even_part[i], odd_part[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_sub_ps(part, offset), scale, acc[i]);
    }
  }
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + n) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i)
    _mm512_storeu_ps(p.y + (m0 + i) * p.N + n, _mm512_add_ps(acc[i], bias));
}

template <int MB>
AVX512 void rows_avx512(const Problem& p, int64_t b, int64_t m0) {
  constexpr int U = MB >= 4 ? 1 : (MB >= 2 ? 2 : 4);
  switch (p.format) {
    case F32: return block_avx512<F32, MB, U>(p, b, m0);
    case BF16: return block_avx512<BF16, MB, U>(p, b, m0);
    case INT8: return block_avx512<INT8, MB, U>(p, b, m0);
    case INT4: return block_avx512_int4<MB>(p, b, m0);
  }
}

AVX512 void blocks_avx512(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m = 0;
    for (; m + 8 <= p.M; m += 8) rows_avx512<8>(p, b, m);
    switch (p.M - m) {
      case 7: rows_avx512<7>(p, b, m); break;
      case 6: rows_avx512<6>(p, b, m); break;
      case 5: rows_avx512<5>(p, b, m); break;
      case 4: rows_avx512<4>(p, b, m); break;
      case 3: rows_avx512<3>(p, b, m); break;
      case 2: rows_avx512<2>(p, b, m); break;
      case 1: rows_avx512<1>(p, b, m); break;
      default: break;
    }
  }
}

// ---- AVX2: a block is two ymm halves (outputs 0-7 and 8-15), two chains per row ----------
#define AVX2 __attribute__((target("avx2,fma,f16c")))

template <Format F>
AVX2 inline __m256 load8(const void* w, int64_t at) {
  if constexpr (F == F32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + at);
  } else if constexpr (F == BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(w) + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {  // INT8
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
        static_cast<const int8_t*>(w) + at));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  }
}

template <Format F, int MB, int U>
AVX2 void block_avx2(const Problem& p, int64_t b, int64_t m0) {
  __m256 acc[MB][U][2];
  for (int i = 0; i < MB; ++i)
    for (int u = 0; u < U; ++u) acc[i][u][0] = acc[i][u][1] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const int64_t base = b * p.K * BLOCK;
  for (int64_t k = 0; k < p.K; k += U) {
    for (int u = 0; u < U; ++u) {
      const __m256 w0 = load8<F>(p.w, base + (k + u) * BLOCK);
      const __m256 w1 = load8<F>(p.w, base + (k + u) * BLOCK + 8);
      for (int i = 0; i < MB; ++i) {
        const __m256 xk = _mm256_set1_ps(x[i * p.K + k + u]);
        acc[i][u][0] = _mm256_fmadd_ps(w0, xk, acc[i][u][0]);
        acc[i][u][1] = _mm256_fmadd_ps(w1, xk, acc[i][u][1]);
      }
    }
  }
  const int64_t n = b * BLOCK;
  for (int h = 0; h < 2; ++h) {
    const __m256 scale = F == INT8 ? _mm256_loadu_ps(p.scales + n + 8 * h) : _mm256_set1_ps(1.f);
    const __m256 bias = p.bias ? _mm256_loadu_ps(p.bias + n + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < MB; ++i) {
      __m256 sum = acc[i][0][h];
      for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[i][u][h]);
      _mm256_storeu_ps(p.y + (m0 + i) * p.N + n + 8 * h, _mm256_fmadd_ps(sum, scale, bias));
    }
  }
}

template <int MB>
AVX2 void block_avx2_int4(const Problem& p, int64_t b, int64_t m0) {
  __m256 acc[MB][2], part[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + b * (p.K / 2) * BLOCK;
  const __m256i low = _mm256_set1_epi32(15);
  const int64_t groups = p.K / p.group, n = b * BLOCK;
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < MB; ++i) part[i][0] = part[i][1] = _mm256_setzero_ps();
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 2) {
      for (int h = 0; h < 2; ++h) {
        __m256i bytes = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + (k / 2) * BLOCK + 8 * h)));
        const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
        const __m256 odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        for (int i = 0; i < MB; ++i) {
          part[i][h] = _mm256_fmadd_ps(even, _mm256_set1_ps(x[i * p.K + k]), part[i][h]);
          part[i][h] = _mm256_fmadd_ps(odd, _mm256_set1_ps(x[i * p.K + k + 1]), part[i][h]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(p.half_scales + (b * groups + g) * BLOCK + 8 * h)));
      for (int i = 0; i < MB; ++i) {
        const __m256 offset = _mm256_set1_ps(8.f * p.xsum[(m0 + i) * groups + g]);
        acc[i][h] = _mm256_fmadd_ps(_mm256_sub_ps(part[i][h], offset), scale, acc[i][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 bias = p.bias ? _mm256_loadu_ps(p.bias + n + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < MB; ++i)
      _mm256_storeu_ps(p.y + (m0 + i) * p.N + n + 8 * h, _mm256_add_ps(acc[i][h], bias));
  }
}

template <int MB>
AVX2 void rows_avx2(const Problem& p, int64_t b, int64_t m0) {
  constexpr int U = MB >= 2 ? 1 : 2;
  switch (p.format) {
    case F32: return block_avx2<F32, MB, U>(p, b, m0);
    case BF16: return block_avx2<BF16, MB, U>(p, b, m0);
    case INT8: return block_avx2<INT8, MB, U>(p, b, m0);
    case INT4: return block_avx2_int4<MB>(p, b, m0);
  }
}

AVX2 void blocks_avx2(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m = 0;
    for (; m + 4 <= p.M; m += 4) rows_avx2<4>(p, b, m);
    switch (p.M - m) {
      case 3: rows_avx2<3>(p, b, m); break;
      case 2: rows_avx2<2>(p, b, m); break;
      case 1: rows_avx2<1>(p, b, m); break;
      default: break;
    }
  }
}
// ---- AVX-512 VNNI: int8 activations per block of 32, vpdpbusd -----------------------------
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))

VNNI inline __m512i broadcast4(const int8_t* x) {  // four int8 as one int32, in every lane
  int32_t four;
  std::memcpy(&four, x, sizeof four);
  return _mm512_set1_epi32(four);
}

// int8: per activation block, 8 vpdpbusd (4 inputs each) into int32, less 128 * the block's
// sum, times its scale; the weights' scales at the end. Two chains when one row runs alone.
template <int MB>
VNNI void block_vnni_int8(const Problem& p, int64_t b, int64_t m0) {
  constexpr int C = MB == 1 ? 4 : (MB <= 3 ? 2 : 1);  // independent chains per row
  const int64_t blocks = p.K / QBLOCK, n = b * BLOCK;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + b * p.K * BLOCK;  // K/4 x 64 bytes
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < blocks; ++j) {
    __m512i dot[MB][C];
    for (int i = 0; i < MB; ++i)
      for (int c = 0; c < C; ++c) dot[i][c] = _mm512_setzero_si512();
    for (int t = 0; t < QBLOCK / 4; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j * (QBLOCK / 4) + t) * 64 + PREFETCH),
                   _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(w + (j * (QBLOCK / 4) + t) * 64);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xi = p.xq + (m0 + i) * p.K + j * QBLOCK + 4 * t;
        dot[i][t % C] = _mm512_dpbusd_epi32(dot[i][t % C], wv, broadcast4(xi));
      }
    }
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * blocks + j;
      __m512i d = dot[i][0];
      for (int c = 1; c < C; ++c) d = _mm512_add_epi32(d, dot[i][c]);
      d = _mm512_sub_epi32(d, _mm512_set1_epi32(128 * p.xqsum[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(p.xscale[at]), acc[i]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(p.scales + n);
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + n) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i)
    _mm512_storeu_ps(p.y + (m0 + i) * p.N + n, _mm512_fmadd_ps(acc[i], scale, bias));
}

// int4: a group of 32 inputs is 4 loads of 64 bytes; each byte's low nibble is one k of the
// first four of eight, its high nibble one of the last four
template <int MB>
VNNI void block_vnni_int4(const Problem& p, int64_t b, int64_t m0) {
  const int64_t groups = p.K / QBLOCK, n = b * BLOCK;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + b * (p.K / 2) * BLOCK;  // K/8 x 64
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  constexpr int C = MB <= 2 ? 2 : 1;  // pairs of independent chains per row
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[MB][2 * C];
    for (int i = 0; i < MB; ++i)
      for (int c = 0; c < 2 * C; ++c) dot[i][c] = _mm512_setzero_si512();
    for (int t = 0; t < QBLOCK / 8; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (g * (QBLOCK / 8) + t) * 64 + PREFETCH),
                   _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w + (g * (QBLOCK / 8) + t) * 64);
      const __m512i first = _mm512_and_si512(v, low);
      const __m512i last = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const int c = 2 * (t % C);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xi = p.xq + (m0 + i) * p.K + g * QBLOCK + 8 * t;
        dot[i][c] = _mm512_dpbusd_epi32(dot[i][c], first, broadcast4(xi));
        dot[i][c + 1] = _mm512_dpbusd_epi32(dot[i][c + 1], last, broadcast4(xi + 4));
      }
    }
    const __m512 wscale = load16_half(p.half_scales + (b * groups + g) * BLOCK);
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * groups + g;
      __m512i d = dot[i][0];
      for (int c = 1; c < 2 * C; ++c) d = _mm512_add_epi32(d, dot[i][c]);
      d = _mm512_sub_epi32(d, _mm512_set1_epi32(8 * p.xqsum[at]));
      const __m512 s = _mm512_mul_ps(wscale, _mm512_set1_ps(p.xscale[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[i]);
    }
  }
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + n) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i)
    _mm512_storeu_ps(p.y + (m0 + i) * p.N + n, _mm512_add_ps(acc[i], bias));
}

template <int MB>
VNNI void rows_vnni(const Problem& p, int64_t b, int64_t m0) {
  if (p.format == INT4) block_vnni_int4<MB>(p, b, m0);
  else block_vnni_int8<MB>(p, b, m0);
}

VNNI void blocks_vnni(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m = 0;
    for (; m + 8 <= p.M; m += 8) rows_vnni<8>(p, b, m);
    switch (p.M - m) {
      case 7: rows_vnni<7>(p, b, m); break;
      case 6: rows_vnni<6>(p, b, m); break;
      case 5: rows_vnni<5>(p, b, m); break;
      case 4: rows_vnni<4>(p, b, m); break;
      case 3: rows_vnni<3>(p, b, m); break;
      case 2: rows_vnni<2>(p, b, m); break;
      case 1: rows_vnni<1>(p, b, m); break;
      default: break;
    }
  }
}
// ---- AVX-512 BF16: bfloat16 weights (pairs layout) times bfloat16 activations, vdpbf16ps ---
#define BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

template <int MB>
BF16DOT void block_bf16dot(const Problem& p, int64_t b, int64_t m0) {
  constexpr int C = MB == 1 ? 4 : (MB <= 3 ? 2 : 1);  // independent chains per row
  const int64_t pairs = p.K / 2, n = b * BLOCK;
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + b * p.K * BLOCK;  // K/2 x 32 values
  const uint32_t* x = p.xpairs + m0 * pairs;
  __m512 acc[MB][C];
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < pairs; t += C) {  // K is a multiple of 8: pairs of C
    for (int c = 0; c < C; ++c) {
      const uint16_t* at = w + (t + c) * 2 * BLOCK;
      _mm_prefetch(reinterpret_cast<const char*>(at) + PREFETCH, _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(at);
      for (int i = 0; i < MB; ++i)
        acc[i][c] = _mm512_dpbf16_ps(acc[i][c], wv,
                                     (__m512bh)_mm512_set1_epi32(x[i * pairs + t + c]));
    }
  }
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + n) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i) {
    __m512 sum = acc[i][0];
    for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, acc[i][c]);
    _mm512_storeu_ps(p.y + (m0 + i) * p.N + n, _mm512_add_ps(sum, bias));
  }
}

BF16DOT void blocks_bf16dot(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m = 0;
    for (; m + 8 <= p.M; m += 8) block_bf16dot<8>(p, b, m);
    switch (p.M - m) {
      case 7: block_bf16dot<7>(p, b, m); break;
      case 6: block_bf16dot<6>(p, b, m); break;
      case 5: block_bf16dot<5>(p, b, m); break;
      case 4: block_bf16dot<4>(p, b, m); break;
      case 3: block_bf16dot<3>(p, b, m); break;
      case 2: block_bf16dot<2>(p, b, m); break;
      case 1: block_bf16dot<1>(p, b, m); break;
      default: break;
    }
  }
}
#endif  // GPT2S_X86

// One packed Linear as the kernels read it.
struct Weights {
  const void* data;
  const void* scales;  // int8: float (N,); int4: float16 (N / 16, K / group, 16); else nullptr
  const float* bias;    // (N,) or nullptr
  int64_t n, format, group, isa;  // n: outputs, a multiple of 16
};

// run(begin, end) over 0..count among torch's threads: each owns a contiguous share and takes
// it in chunks from the front; one done early takes chunks from the back of the share with the
// most left, so a thread the host delays (a busy machine, a noisy neighbour) holds up the call
// by one chunk, not by its whole share
template <typename Run>
void in_shares(int64_t count, const Run& run) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) return run(0, count);
  struct Share { int64_t front, back; };
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t)
    shares[t] = {count * t / threads, count * (t + 1) / threads};
  const int64_t chunk = std::max<int64_t>(1, count / (threads * 8));
  std::mutex mutex;
  auto next = [&](int64_t own, int64_t& from, int64_t& to) {
    std::lock_guard<std::mutex> hold(mutex);
    Share& mine = shares[own];
    if (mine.front < mine.back) {
      from = mine.front;
      to = mine.front = std::min(mine.back, from + chunk);
      return true;
    }
    Share* most = &shares[0];
    for (Share& s : shares)
      if (s.back - s.front > most->back - most->front) most = &s;
    if (most->back <= most->front) return false;
    to = most->back;
    from = most->back = std::max(most->front, to - chunk);
    return true;
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    int64_t from = 0, to = 0;
    for (int64_t own = begin; own < end; ++own)
      while (next(own, from, to)) run(from, to);
  });
}

// y (M, n) = x (M, K) @ W^T (+ bias): the blocks of outputs shared among torch's threads
void product(const float* x, int64_t M, int64_t K, const Weights& w, float* y) {
  const bool half = w.format == INT4;
  Problem p{x, w.data, half ? nullptr : static_cast<const float*>(w.scales),
            half ? static_cast<const uint16_t*>(w.scales) : nullptr, w.bias, nullptr, y, M, K,
            w.n, w.group, static_cast<Format>(w.format)};
  std::vector<int8_t> xq;
  std::vector<float> xscale, xsum;
  std::vector<int32_t> xqsum;
  std::vector<uint32_t> xpairs;
  if (w.isa == 4) {
    xpairs.resize(M * K / 2);
    bf16_pairs(x, M * K, xpairs.data());
    p.xpairs = xpairs.data();
  } else if (w.isa == 3) {
    xq.resize(M * K);
    xscale.resize(M * K / QBLOCK);
    xqsum.resize(M * K / QBLOCK);
    quantize_rows(x, M, K, xq.data(), xscale.data(), xqsum.data());
    p.xq = xq.data();
    p.xscale = xscale.data();
    p.xqsum = xqsum.data();
  } else if (w.format == INT4) {
    xsum.assign(M * (K / w.group), 0.f);
    for (int64_t i = 0; i < M * K; ++i) xsum[i / w.group] += x[i];
    p.xsum = xsum.data();
  }
  auto run = [&](int64_t begin, int64_t end) {
#ifdef GPT2S_X86
    if (w.isa == 4) return blocks_bf16dot(p, begin, end);
    if (w.isa == 3) return blocks_vnni(p, begin, end);
    if (w.isa == 2) return blocks_avx512(p, begin, end);
    if (w.isa == 1) return blocks_avx2(p, begin, end);
#endif
    blocks_portable(p, begin, end);
  };
  in_shares(w.n / BLOCK, run);
}

const float* float_ptr(const at::Tensor& t) {
  return t.numel() ? static_cast<const float*>(t.const_data_ptr()) : nullptr;
}

Weights weights_of(int64_t K, const at::Tensor& data, const at::Tensor& scales,
                   const at::Tensor& bias, int64_t n, int64_t format, int64_t group,
                   int64_t isa) {
  TORCH_CHECK(n % BLOCK == 0, "gpt2s: N must be a multiple of 16, got ", n);
  TORCH_CHECK(K % 8 == 0, "gpt2s: K must be a multiple of 8, got ", K);
  TORCH_CHECK(format >= F32 && format <= INT4, "gpt2s: unknown format ", format);
  TORCH_CHECK(format != INT4 || (group > 0 && group % 2 == 0 && K % group == 0),
              "gpt2s: int4 needs an even group that divides K");
  TORCH_CHECK(isa != 3 || ((format == INT8 || (format == INT4 && group == QBLOCK)) &&
                           K % QBLOCK == 0),
              "gpt2s: the VNNI path takes int8, or int4 in groups of 32, and K a multiple of 32");
  TORCH_CHECK(isa != 4 || format == BF16, "gpt2s: the BF16 path takes bfloat16 weights");
  TORCH_CHECK(isa >= 0 && isa <= 4, "gpt2s: unknown kernel path ", isa);
  TORCH_CHECK(data.is_contiguous() && (!bias.numel() || bias.numel() == n),
              "gpt2s: packed weights must be contiguous and the bias padded to N");
  TORCH_CHECK(format != INT4 || scales.scalar_type() == at::kHalf,
              "gpt2s: int4 scales must be float16");
  TORCH_CHECK(format != INT8 || scales.scalar_type() == at::kFloat,
              "gpt2s: int8 scales must be float32");
  return {data.const_data_ptr(), scales.numel() ? scales.const_data_ptr() : nullptr,
          float_ptr(bias), n, format, group, isa};
}

// y = x @ W^T (+ bias) for x (M, K) float32 and W packed as above with N outputs (N a multiple
// of 16: the caller pads).
at::Tensor weight_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                         const std::optional<at::Tensor>& bias, int64_t n, int64_t format,
                         int64_t group, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "weight_matmul: x must be a contiguous float32 (M, K) matrix");
  const Weights w = weights_of(x.size(1), weight, scales, bias ? *bias : at::Tensor(), n,
                               format, group, isa);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  product(static_cast<const float*>(x.const_data_ptr()), x.size(0), x.size(1), w,
          static_cast<float*>(y.data_ptr()));
  return y;
}

// ---- one transformer block for tokens being decoded -----------------------------------------
// The block's math as GPT.forward runs it in float32 (LayerNorm, attention over the cache with
// a softmax in float32, tanh or erf GELU), for B rows each one token at its own position, in
// one call: the Python between the products (~15 small ops a block) was a third of a token.

__attribute__((target_clones("avx512f", "avx2", "default")))
void layer_norm(const float* x, int64_t C, const float* w, const float* b, float eps, float* out) {
  float mean = 0.f, var = 0.f;
#pragma omp simd reduction(+ : mean)
  for (int64_t i = 0; i < C; ++i) mean += x[i];
  mean /= C;
#pragma omp simd reduction(+ : var)
  for (int64_t i = 0; i < C; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.f / std::sqrt(var / C + eps);
  for (int64_t i = 0; i < C; ++i) out[i] = (x[i] - mean) * inv * w[i] + (b ? b[i] : 0.f);
}

// exp(x) to about 2 ulp, written so the compiler vectorizes the loops that call it: 2^n by the
// exponent bits, e^r by its Taylor series to r^7 (|r| <= ln 2 / 2)
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float poly = 1.f / 5040;
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) poly = poly * r + c;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return poly * two_n;
}

// model.Activation.kernel_id: 0, GPT-2's tanh GELU, tanh(u) as 1 - 2 / (e^2u + 1); 1, the
// exact one, erf by Abramowitz and Stegun 7.1.26 (error below 1.5e-7); 2, relu(x)^2
__attribute__((target_clones("avx512f", "avx2", "default")))
void activation(float* f, int64_t count, int64_t kind) {
  constexpr float root = 0.7978845608028654f;  // sqrt(2 / pi)
  if (kind == 2) {
    for (int64_t i = 0; i < count; ++i) {
      const float v = f[i] > 0.f ? f[i] : 0.f;
      f[i] = v * v;
    }
    return;
  }
  if (kind == 1) {
    for (int64_t i = 0; i < count; ++i) {
      const float v = f[i], a = std::abs(v) * 0.7071067811865476f;
      const float t = 1.f / (1.f + 0.3275911f * a);
      const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f +
                         t * (-1.453152027f + t * 1.061405429f))));
      const float erf_a = 1.f - poly * fast_exp(-a * a);
      f[i] = 0.5f * v * (1.f + (v < 0.f ? -erf_a : erf_a));
    }
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    const float v = f[i], u = root * (v + 0.044715f * v * v * v);
    f[i] = 0.5f * v * (2.f - 2.f / (fast_exp(2.f * u) + 1.f));
  }
}

// one query against n keys and values (hs wide, rows hs apart): softmax(q.k / sqrt(hs)) . v
__attribute__((target_clones("avx512f", "avx2", "default")))
void attend_head(const float* q, const float* keys, const float* values, int64_t n, int64_t hs,
                 float scale, float* p, float* out) {
  float peak = -INFINITY, total = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    float score = 0.f;
#pragma omp simd reduction(+ : score)
    for (int64_t i = 0; i < hs; ++i) score += q[i] * keys[t * hs + i];
    p[t] = score * scale;
    peak = std::max(peak, p[t]);
  }
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) total += (p[t] = fast_exp(p[t] - peak));
  for (int64_t i = 0; i < hs; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    const float weight = p[t] / total;
    for (int64_t i = 0; i < hs; ++i) out[i] += weight * values[t * hs + i];
  }
}

// qkv (B, 3C) -> y (B, C) for B tokens, token b in cache row row[b] at position pos[b]: every
// token's key and value written at its place in the cache (2, rows, nh, T, hs) first, then its
// query against positions 0..pos[b] of its row (so the tokens of one prompt, in order, attend
// to each other causally)
void attend(const float* qkv, float* kv, const int64_t* row, const int64_t* pos, int64_t B,
            int64_t rows, int64_t nh, int64_t T, int64_t hs, float* y) {
  const int64_t C = nh * hs, plane = rows * nh * T * hs;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nh; ++h) {
      float* k = kv + ((row[b] * nh + h) * T + pos[b]) * hs;
      std::memcpy(k, qkv + b * 3 * C + C + h * hs, hs * sizeof(float));
      std::memcpy(k + plane, qkv + b * 3 * C + 2 * C + h * hs, hs * sizeof(float));
    }
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  in_shares(B * nh, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> p;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / nh, h = bh % nh, n = pos[b] + 1;
      const float* keys = kv + (row[b] * nh + h) * T * hs;
      p.resize(n);
      attend_head(qkv + b * 3 * C + h * hs, keys, keys + plane, n, hs, scale, p.data(),
                  y + b * C + h * hs);
    }
  });
}

// row-wise f over B rows among the threads, when they are enough work to share
template <typename F>
void for_rows(int64_t B, int64_t width, const F& f) {
  // elements: below this, one thread is quicker (16 rows' GELU, 49k, shared: a batch-16 bf16
  // decode step 21.2 -> 19.0 ms on the Zen 4 EPYC; a row alone, 3k, stays on one)
  constexpr int64_t WORTH_SHARING = 8192;
  if (B * width < WORTH_SHARING) {
    for (int64_t b = 0; b < B; ++b) f(b);
    return;
  }
  in_shares(B, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) f(b);
  });
}

// x (B, C) -> x after the block, for B tokens: token b in cache row rows[b] at positions[b].
// kv: this block's cache (2, rows, nh, T, hs); ln: (weight, bias) of ln_1 and ln_2 (a bias may
// be empty); the four Linears c_attn, attn.c_proj, c_fc, mlp.c_proj packed in one format.
at::Tensor decode_block(const at::Tensor& x, at::Tensor kv, const at::Tensor& rows,
                        const at::Tensor& positions, at::TensorList ln, double eps,
                        at::TensorList data, at::TensorList scales, at::TensorList bias,
                        at::IntArrayRef n, int64_t format, int64_t group, int64_t isa,
                        int64_t n_head, int64_t activation_kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_block: x must be a contiguous float32 (B, C) matrix");
  TORCH_CHECK(kv.dim() == 5 && kv.scalar_type() == at::kFloat && kv.is_contiguous() &&
                  kv.size(0) == 2 && kv.size(2) == n_head,
              "decode_block: the cache must be a contiguous float32 (2, rows, nh, T, hs)");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0) &&
                  rows.scalar_type() == at::kLong && rows.numel() == x.size(0) &&
                  positions.is_contiguous() && rows.is_contiguous(),
              "decode_block: one int64 cache row and position per token");
  TORCH_CHECK(ln.size() == 4 && data.size() == 4 && scales.size() == 4 && bias.size() == 4 &&
                  n.size() == 4, "decode_block: four Linears and two LayerNorms");
  const int64_t B = x.size(0), C = x.size(1), T = kv.size(3), hs = kv.size(4);
  const int64_t* pos = static_cast<const int64_t*>(positions.const_data_ptr());
  const int64_t* row = static_cast<const int64_t*>(rows.const_data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < T, "decode_block: position ", pos[b], " outside 0..",
                T - 1);
    TORCH_CHECK(row[b] >= 0 && row[b] < kv.size(1), "decode_block: cache row ", row[b],
                " outside 0..", kv.size(1) - 1);
  }
  const int64_t inputs[4] = {C, C, C, n[2]};
  Weights w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = weights_of(inputs[i], data[i], scales[i], bias[i], n[i], format, group, isa);
  TORCH_CHECK(n[0] >= 3 * C && n[1] >= C && n[3] >= C, "decode_block: Linear sizes do not fit");
  at::Tensor out = x.clone();
  float* h = out.data_ptr<float>();
  std::vector<float> normed(B * C), wide(B * std::max(n[0], n[2])), y(B * C), proj(B * n[1]);
  const float* ln1_w = float_ptr(ln[0]); const float* ln1_b = float_ptr(ln[1]);
  const float* ln2_w = float_ptr(ln[2]); const float* ln2_b = float_ptr(ln[3]);
  for_rows(B, C, [&](int64_t b) {
    layer_norm(h + b * C, C, ln1_w, ln1_b, eps, normed.data() + b * C);
  });
  product(normed.data(), B, C, w[0], wide.data());
  std::vector<float> qkv(B * 3 * C);  // the first 3C outputs of each row
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(qkv.data() + b * 3 * C, wide.data() + b * n[0], 3 * C * sizeof(float));
  attend(qkv.data(), kv.data_ptr<float>(), row, pos, B, kv.size(1), n_head, T, hs, y.data());
  product(y.data(), B, C, w[1], proj.data());
  for_rows(B, C, [&](int64_t b) {
    for (int64_t i = 0; i < C; ++i) h[b * C + i] += proj[b * n[1] + i];
    layer_norm(h + b * C, C, ln2_w, ln2_b, eps, normed.data() + b * C);
  });
  product(normed.data(), B, C, w[2], wide.data());
  for_rows(B, n[2], [&](int64_t b) { activation(wide.data() + b * n[2], n[2], activation_kind); });
  product(wide.data(), B, n[2], w[3], proj.data());
  for_rows(B, C, [&](int64_t b) {
    for (int64_t i = 0; i < C; ++i) h[b * C + i] += proj[b * n[3] + i];
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(gpt2s, m) {
  m.def("weight_matmul(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int n, int format, "
        "int group, int isa) -> Tensor");
  m.def("decode_block(Tensor x, Tensor(a!) kv, Tensor rows, Tensor positions, Tensor[] ln, "
        "float eps, Tensor[] data, Tensor[] scales, Tensor[] bias, int[] n, int format, "
        "int group, int isa, int n_head, int activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2s, CPU, m) {
  m.impl("weight_matmul", &weight_matmul);
  m.impl("decode_block", &decode_block);
}
