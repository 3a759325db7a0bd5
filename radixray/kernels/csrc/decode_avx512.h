// The AVX-512 paged decode attention (decode_avx512.cpp), called by attention.cpp.
#pragma once
#include <cstdint>

template <typename T>  // pool element: float, uint16_t (bf16 bits) or uint8_t (fp8 e5m2 bits)
struct DecodeArgs {
  const float* Q;      // [B, H, D]
  const T* KP;         // [S, KVH, D]
  const T* VP;
  const int64_t* IDX;  // [B, Lmax]
  const int64_t* LEN;  // [B]
  float* O;            // [B, H, D]
  int64_t B, H, D, KVH, Lmax;
  float sc;
};

// Runs the kernel and returns true where this CPU and these shapes allow it; false leaves O
// untouched for the AVX2 kernel.
template <typename T>
bool paged_decode_attention_avx512(const DecodeArgs<T>& args);

// Whether this CPU has the AVX-512 subsets the kernel needs.
bool decode_avx512_supported();

// Whether paged_decode_attention_avx512 runs where it can (default true); tests turn it off
// to check the AVX2 kernel on AVX-512 machines.
bool& decode_avx512_enabled();
